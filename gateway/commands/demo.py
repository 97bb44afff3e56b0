"""`kvgate demo`: the main job on one machine — emulated SGLang prefill/decode engines at the addresses the demo
config names, and the gateway in front of them (in-memory state, the GLM-5 tokenizer shipped with the project).

The engines emulate the 2026 incident's cluster: a 1,048,576-token context advertised over 681,280-token KV pools,
with SGLang 0.5.8's leak bug switched on. The gateway's KV-pool gate measures the pools and clamps the model's limit
(config/demo.yaml sets `on_pool_mismatch: clamp`), so the leak cannot be reached through it. The engines are started
as a user would start them (`python -m loadtests.engine ...`); the gateway imports nothing of the emulator.
"""

from __future__ import annotations

import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from gateway.commands.supervisor import serve
from gateway.config import ModelConfig, PrefillWorkerConfig, load_config

ROOT = Path(__file__).resolve().parents[2]  # the checkout: gateway/commands/demo.py
DEMO_CONFIG = ROOT / "config" / "demo.yaml"
DEMO_POOL_TOKENS = 681_280
_READY_PREFIX = "kvgate-engine ready"
_STARTUP_S = 120.0


def run_demo(config_path: str | None) -> int:
    path = Path(config_path) if config_path else DEMO_CONFIG
    config = load_config(path)
    commands = [command for model in config.models for command in _engine_commands(model)]
    # uvicorn re-raises SIGTERM once it has shut down; turning it into SystemExit lets the engines stop below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    engines = [subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True) for _, argv in commands]
    try:
        for (role, argv), engine in zip(commands, engines):
            _wait_ready(engine, role)
            print(f"kvgate demo: emulated {role} engine on port {argv[argv.index('--port') + 1]} "
                  f"(KV pool {DEMO_POOL_TOKENS} tokens, SGLang 0.5.8 leak bug on)", flush=True)
        host, port = config.listen.host, config.listen.port
        print(f"kvgate demo: gateway on http://{host}:{port} — try\n"
              f"  curl -s http://{host}:{port}/v1/chat/completions -H 'content-type: application/json' "
              "-d '{\"model\":\"glm-5\",\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}]}'", flush=True)
        return serve(config, log_level="info")
    finally:
        for engine in engines:
            engine.terminate()
        for engine in engines:
            try:
                engine.wait(timeout=10)
            except subprocess.TimeoutExpired:
                engine.kill()


def _engine_commands(model: ModelConfig) -> list[tuple[str, list[str]]]:
    common = ["--model", model.name, "--pool-tokens", str(DEMO_POOL_TOKENS), "--context-length",
              str(model.context_length), "--tokenizer", str(model.tokenizer), "--version", "0.5.8", "--bug"]
    if model.chat_template is not None:
        common += ["--chat-template", str(model.chat_template)]
    prefill = [w for w in model.static_workers("prefill") if isinstance(w, PrefillWorkerConfig)]
    bootstrap_port = prefill[0].bootstrap_port or 8998
    commands = []
    for role, url, port in ([("prefill", w.url, w.bootstrap_port or 8998) for w in prefill]
                            + [("decode", w.url, bootstrap_port) for w in model.static_workers("decode")]):
        parts = urlsplit(url)
        commands.append((role, [sys.executable, "-m", "loadtests.engine", "--role", role, "--host",
                                parts.hostname or "127.0.0.1", "--port", str(parts.port), "--bootstrap-port",
                                str(port), *common]))
    return commands


def _wait_ready(engine: subprocess.Popen[str], role: str) -> None:
    assert engine.stdout is not None
    deadline = time.monotonic() + _STARTUP_S
    while time.monotonic() < deadline and engine.poll() is None:
        if select.select([engine.stdout], [], [], 0.2)[0] and engine.stdout.readline().startswith(_READY_PREFIX):
            return
    raise SystemExit(f"kvgate demo: the emulated {role} engine did not start")
