"""`python -m loadtests.engine`: argument parsing, startup, the ready line, clean SIGTERM exit."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys

from .config import EngineConfig
from .dialect import dialect_of
from .kv_event_publisher import KvEventsConfig


def parse_args(argv: list[str] | None = None) -> EngineConfig:
    p = argparse.ArgumentParser(prog="python -m loadtests.engine",
                                description="SGLang prefill/decode engine emulator (see loadtests/README.md)")
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--bootstrap-port", type=int, default=8998,
                   help="prefill: where the bootstrap server listens; decode: used when a request's "
                        "bootstrap_port is null")
    p.add_argument("--model", required=True, help="served model name (also reported as model_path)")
    p.add_argument("--pool-tokens", type=int, required=True, help="KV pool size in tokens (max_total_num_tokens)")
    p.add_argument("--context-length", type=int, required=True)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--tokenizer", required=True, help="tokenizer.json, tokenizer.json.gz or a tokenizer directory")
    p.add_argument("--chat-template", default=None,
                   help="jinja chat template (default: chat_template.jinja next to the tokenizer, if any)")
    p.add_argument("--bug", action=argparse.BooleanOptionalAction, default=True,
                   help="0.5.8 behaviour (default); --no-bug: 0.5.22+ admission rejects over-long prompts with 400")
    p.add_argument("--prefill-tokens-per-s", type=float, default=0.0, help="prefill compute speed; 0 = instant")
    p.add_argument("--first-token-delay-ms", type=float, default=0.0, help="decode: extra delay before token 1")
    p.add_argument("--token-delay-ms", type=float, default=0.0, help="decode: delay between output tokens")
    p.add_argument("--version", default="0.5.8",
                   help="reported SGLang version; request handling follows 0.5.8 (< 0.5.22), 0.5.22 or 0.5.23 (>=)")
    p.add_argument("--bootstrap-timeout-s", type=float, default=300.0,
                   help="SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT: prefill waits this long for the decode")
    p.add_argument("--waiting-timeout-s", type=float, default=300.0,
                   help="SGLANG_DISAGGREGATION_WAITING_TIMEOUT: decode waits this long for the transfer")
    p.add_argument("--enable-metrics", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--disconnect-poll-s", type=float, default=4.0,
                   help="SGLANG_REQUEST_STATE_WAIT_TIMEOUT: non-stream disconnects are noticed on this period")
    p.add_argument("--stream-abort-delay-s", type=float, default=2.0,
                   help="a stream whose client left is aborted this long after (create_abort_task)")
    p.add_argument("--health-delay-s", type=float, default=1.0,
                   help="/health and /health_generate answer after this long (SGLang polls every 1 s)")
    p.add_argument("--request-log-size", type=int, default=200_000, help="records kept for /emu/requests")
    p.add_argument("--transfer-backend", default="mooncake",
                   choices=("mooncake", "mooncake_tcp", "nixl", "mori", "ascend", "fake"),
                   help="disaggregation_transfer_backend (reported resolved: mooncake_tcp as mooncake)")
    p.add_argument("--enable-kv-checksum", action=argparse.BooleanOptionalAction, default=False,
                   help="disaggregation_enable_kv_checksum (0.5.22+)")
    p.add_argument("--decode-allocation-policy", default="early", choices=("early", "prefill_complete"),
                   help="disaggregation_decode_allocation_policy (0.5.22+)")
    p.add_argument("--default-chat-template-kwargs", type=json.loads, default=None,
                   help="JSON object (0.5.22+): fills what a chat request's chat_template_kwargs leave unset")
    p.add_argument("--expose-env-vars", action=argparse.BooleanOptionalAction, default=False,
                   help="SGLANG_EXPOSE_OWN_ENV_VARS=1 (0.5.22+): list the --env variables in server info")
    p.add_argument("--report-pool-tokens", type=int, default=None,
                   help="claim this KV pool in /server_info (a lying engine, to test what catches a leak anyway)")
    p.add_argument("--dp-rank-pool-tokens", type=int, action="append", default=[],
                   help="a further data-parallel rank with this KV pool (repeatable): internal_states[1:] report "
                        "each rank's token capacity, the top level rank 0's")
    p.add_argument("--hide-stub", action=argparse.BooleanOptionalAction, default=False,
                   help="bug mode: the one-token stub reports the original prompt's count (a lying engine)")
    p.add_argument("--cache-tokens", type=int, default=None,
                   help="prefill: radix prefix cache capacity in tokens (default: the pool size)")
    p.add_argument("--kv-events-config", default=None,
                   help='prefill: publish KV cache events, e.g. {"publisher": "zmq", "endpoint": "tcp://*:5557", '
                        '"replay_endpoint": "tcp://*:5558", "topic": "", "buffer_steps": 10000}')
    p.add_argument("--enable-cache-report", action=argparse.BooleanOptionalAction, default=False,
                   help="OpenAI usage reports prompt_tokens_details.cached_tokens")
    p.add_argument("--num-reserved-decode-tokens", type=int, default=512,
                   help="decode: a request is preallocated once prompt + max_new_tokens + this fits the free KV")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable set explicitly for the engine (repeatable)")
    a = p.parse_args(argv)
    env = []
    for item in a.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            p.error(f"--env expects NAME=VALUE, got {item!r}")
        env.append((name, value))
    if a.pool_tokens < a.page_size or a.context_length < 8:
        p.error("--pool-tokens must hold at least one page and --context-length must be >= 8")
    try:
        dialect = dialect_of(a.version)
    except ValueError as e:
        p.error(str(e))
    if a.kv_events_config is not None:
        try:
            KvEventsConfig.parse(a.kv_events_config, dialect)
        except ValueError as e:  # json.JSONDecodeError included
            p.error(f"--kv-events-config: {e}")
    if (a.cache_tokens is not None and a.cache_tokens < 0) or a.num_reserved_decode_tokens < 0:
        p.error("--cache-tokens and --num-reserved-decode-tokens must be >= 0")
    return EngineConfig(
        role=a.role, host=a.host, port=a.port, bootstrap_port=a.bootstrap_port, model=a.model,
        pool_tokens=a.pool_tokens, context_length=a.context_length, page_size=a.page_size, tokenizer=a.tokenizer,
        chat_template=a.chat_template, bug=a.bug, prefill_tokens_per_s=a.prefill_tokens_per_s,
        first_token_delay_ms=a.first_token_delay_ms, token_delay_ms=a.token_delay_ms, version=a.version,
        bootstrap_timeout_s=a.bootstrap_timeout_s, waiting_timeout_s=a.waiting_timeout_s,
        enable_metrics=a.enable_metrics, disconnect_poll_s=a.disconnect_poll_s,
        stream_abort_delay_s=a.stream_abort_delay_s, health_delay_s=a.health_delay_s,
        request_log_size=a.request_log_size, transfer_backend=a.transfer_backend,
        enable_kv_checksum=a.enable_kv_checksum, decode_allocation_policy=a.decode_allocation_policy,
        expose_env_vars=a.expose_env_vars, env=tuple(env), report_pool_tokens=a.report_pool_tokens,
        dp_rank_pool_tokens=tuple(a.dp_rank_pool_tokens), hide_stub=a.hide_stub,
        default_chat_template_kwargs=a.default_chat_template_kwargs,
        cache_tokens=a.cache_tokens, kv_events_config=a.kv_events_config, enable_cache_report=a.enable_cache_report,
        num_reserved_decode_tokens=a.num_reserved_decode_tokens)


async def serve(cfg: EngineConfig) -> None:
    from .app import bootstrap_server, main_server
    from .engine import Engine
    from .tokenizer import PromptTokenizer

    engine = Engine(cfg, PromptTokenizer(cfg.tokenizer, cfg.chat_template, cfg.dialect))
    servers = [main_server(engine)]
    await servers[0].start(cfg.host, cfg.port)
    if cfg.role == "prefill":
        servers.append(bootstrap_server(engine))
        await servers[1].start(cfg.host, cfg.bootstrap_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    bp = f" bootstrap_port={cfg.bootstrap_port}" if cfg.role == "prefill" else ""
    print(f"kvgate-engine ready role={cfg.role} host={cfg.host} port={cfg.port}{bp} pid={os.getpid()}", flush=True)
    await stop.wait()
    engine.close_kv_events()
    engine.links.close()
    engine.rooms.close_channels()
    engine.tok.close()
    for s in servers:
        await s.close()


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    try:
        import uvloop
        uvloop.install()
    except ImportError:  # uvloop is optional (not on Windows)
        pass
    try:
        asyncio.run(serve(cfg))
    except OSError as e:
        print(f"kvgate-engine: cannot start: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
