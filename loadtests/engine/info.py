"""Non-generation SGLang endpoints: health, server/model info, models, load, metrics, flush_cache, abort_request."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timezone
from typing import Any

import orjson

from .config import EngineConfig
from .dialect import Dialect
from .engine import Engine
from .httpcore import TEXT, Request
from .metrics import Metrics

_FLUSH_MSG = (b"Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
              b"requests, the operation will not be performed.)\n")


# `disaggregation_transfer_backend` as ServerArgs.resolved_dict() reports it (0.5.22+)
_RESOLVED_BACKEND = {"mooncake_tcp": "mooncake"}


def server_args(cfg: EngineConfig, tokenizer_path: str) -> dict[str, Any]:
    """The ServerArgs fields a gateway may read (server_info flattens them at the top level). 0.5.8 reports the
    backend as given and has no checksum or allocation-policy field."""
    modern = cfg.dialect is not Dialect.V0_5_8
    backend = _RESOLVED_BACKEND.get(cfg.transfer_backend, cfg.transfer_backend) if modern else cfg.transfer_backend
    extra: dict[str, Any] = {"disaggregation_enable_kv_checksum": cfg.enable_kv_checksum,
                             "disaggregation_decode_allocation_policy": cfg.decode_allocation_policy,
                             "default_chat_template_kwargs": cfg.default_chat_template_kwargs} if modern else {}
    return {**extra,
        "model_path": cfg.model, "tokenizer_path": tokenizer_path, "served_model_name": cfg.model,
        "host": cfg.host, "port": cfg.port, "context_length": cfg.context_length, "page_size": cfg.page_size,
        "max_total_tokens": cfg.pool_tokens, "max_running_requests": None, "max_queued_requests": None,
        "chunked_prefill_size": None, "max_prefill_tokens": 16384, "mem_fraction_static": None,
        "allow_auto_truncate": False, "tp_size": 1, "dp_size": 1, "pp_size": 1, "load_balance_method": "round_robin",
        "disaggregation_mode": cfg.role, "disaggregation_bootstrap_port": cfg.bootstrap_port,
        "disaggregation_transfer_backend": backend, "disaggregation_decode_tp": None,
        "disaggregation_decode_dp": None, "disaggregation_ib_device": None, "num_reserved_decode_tokens": 512,
        "enable_metrics": cfg.enable_metrics, "skip_tokenizer_init": False, "stream_output": False,
        "chat_template": cfg.chat_template, "completion_template": None,
    }


class InfoAPI:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cfg = engine.cfg

    async def health(self, req: Request) -> None:
        """A real 1-token FAKE-backend run through the pool, answered after `health_delay_s` (SGLang polls 1 s)."""
        fault = self.engine.faults.take("health", req.path)
        if fault is not None:
            if fault.delay_ms:
                await asyncio.sleep(fault.delay_ms / 1000)
            req.respond(fault.status, b"", TEXT)
            return
        pool = self.engine.pool
        pages = await pool.alloc(1)
        try:
            if self.cfg.health_delay_s > 0:
                await asyncio.sleep(self.cfg.health_delay_s)
        finally:
            pool.free(pages, 1)
        req.respond(200, b"", TEXT)

    def _internal_state(self) -> dict[str, Any]:
        cfg = self.cfg
        state = {**server_args(cfg, self.engine.tok.path), "last_gen_throughput": self.engine.gen_throughput(),
                 "memory_usage": {"weight": 0.0, "kvcache": 0.0, "token_capacity": cfg.max_total_num_tokens,
                                  "graph": 0.0},
                 "effective_max_running_requests_per_dp": 4096, "disaggregation_mode": cfg.role}
        if cfg.expose_env_vars and cfg.dialect is not Dialect.V0_5_8:
            # exportable_env_vars(): only the Envs fields present in the environment, never MC_* (Mooncake's own)
            state["env_vars"] = {name: value for name, value in cfg.env if name.startswith("SGLANG_")}
        return state

    async def server_info(self, req: Request) -> None:
        cfg = self.cfg
        body = {**server_args(cfg, self.engine.tok.path), "status": "ready",
                "max_total_num_tokens": cfg.reported_pool_tokens, "max_req_input_len": cfg.reported_max_req_input_len,
                "internal_states": [self._internal_state()], "version": cfg.version}
        req.respond(200, orjson.dumps(body))

    async def model_info(self, req: Request) -> None:
        req.respond(200, orjson.dumps({
            "model_path": self.cfg.model, "tokenizer_path": self.engine.tok.path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default", "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": "glm_moe", "architectures": ["EmulatedForCausalLM"]}))

    async def models(self, req: Request) -> None:
        req.respond(200, orjson.dumps({"object": "list", "data": [{
            "id": self.cfg.model, "object": "model", "created": int(self.engine.started), "owned_by": "sglang",
            "root": self.cfg.model, "parent": None, "max_model_len": self.cfg.context_length}]}))

    def _counts(self) -> tuple[int, int, int, dict[str, int]]:
        q = self.engine.queue_counts()
        waiting = q["bootstrap"] + q["prealloc"] + q["transfer"]
        running = len(self.engine.inflight) - waiting
        num_tokens = self.engine.pool.used_tokens + self.engine.waiting_tokens()
        return running, waiting, num_tokens, q

    async def get_load(self, req: Request) -> None:
        running, waiting, num_tokens, _ = self._counts()
        req.respond(200, orjson.dumps([{"rid": None, "http_worker_ipc": None, "dp_rank": 0,
                                        "num_reqs": running + waiting, "num_waiting_reqs": waiting,
                                        "num_tokens": num_tokens, "ts_tic": time.time()}]))

    async def loads(self, req: Request) -> None:
        cfg, pool = self.cfg, self.engine.pool
        running, waiting, _, q = self._counts()
        usage = pool.used_tokens / cfg.max_total_num_tokens
        throughput = self.engine.gen_throughput()
        load: dict[str, Any] = {
            "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
            "num_used_tokens": pool.used_tokens, "max_total_num_tokens": cfg.max_total_num_tokens,
            "token_usage": usage, "gen_throughput": throughput, "cache_hit_rate": 0.0, "utilization": usage,
            "max_running_requests": 4096,
            "memory": {"weight_gb": 0.0, "kv_cache_gb": 0.0, "graph_gb": 0.0,
                       "token_capacity": cfg.max_total_num_tokens},
            "disaggregation": {"mode": cfg.role, "prefill_prealloc_queue_reqs": q["bootstrap"],
                               "prefill_inflight_queue_reqs": q["inflight"],
                               "decode_prealloc_queue_reqs": q["prealloc"],
                               "decode_transfer_queue_reqs": q["transfer"]},
        }
        if req.query.get("format") == "prometheus":
            lines = [f"sglang_{k}{{dp_rank=\"0\"}} {v}" for k, v in load.items()
                     if isinstance(v, (int, float)) and k != "dp_rank"]
            req.respond(200, ("\n".join(lines) + "\n").encode(), TEXT)
            return
        req.respond(200, orjson.dumps({
            "timestamp": datetime.now(timezone.utc).isoformat(), "version": cfg.version, "dp_rank_count": 1,
            "loads": [load],
            "aggregate": {"total_running_reqs": running, "total_waiting_reqs": waiting,
                          "total_reqs": running + waiting, "avg_token_usage": usage, "avg_throughput": throughput,
                          "avg_utilization": usage}}))

    async def metrics(self, req: Request) -> None:
        req.respond(200, self.engine.metrics.render(self._refresh), b"text/plain; version=0.0.4; charset=utf-8")

    def _refresh(self, m: Metrics) -> None:
        cfg, pool = self.cfg, self.engine.pool
        running, waiting, _, q = self._counts()
        m.num_running_reqs.set(running)
        m.num_queue_reqs.set(0)  # PD servers queue in the disaggregation queues below
        m.num_used_tokens.set(pool.used_tokens)
        m.token_usage.set(pool.used_tokens / cfg.max_total_num_tokens)
        m.max_total_num_tokens.set(cfg.max_total_num_tokens)
        m.cache_hit_rate.set(0.0)
        m.gen_throughput.set(self.engine.gen_throughput())
        m.prefill_prealloc.set(q["bootstrap"])
        m.prefill_inflight.set(q["inflight"])
        m.decode_prealloc.set(q["prealloc"])
        m.decode_transfer.set(q["transfer"])

    async def flush_cache(self, req: Request) -> None:
        req.respond(400 if self.engine.inflight else 200, _FLUSH_MSG, TEXT)

    async def abort_request(self, req: Request) -> None:
        """Prefix match on rid, as `Scheduler.abort_request` does; unknown rids are a silent no-op."""
        try:
            body = orjson.loads(req.body or b"{}")
            rid = body.get("rid") or ""
            abort_all = bool(body.get("abort_all", False))
            if not isinstance(rid, str):
                raise ValueError("rid must be a string")
        except (ValueError, AttributeError) as e:
            req.respond(400, orjson.dumps({"error": {"message": str(e)}}))
            return
        if rid or abort_all:
            self.engine.abort_prefix(rid, abort_all)
        req.respond(200, b"", TEXT)
