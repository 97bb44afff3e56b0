"""`kvgate demo`: the main job on one machine — emulated SGLang prefill/decode engines at the addresses the demo
config names, and the gateway in front of them (in-memory state, the GLM-5 tokenizer shipped with the project).

The engines emulate the 2026 incident's cluster: a 1,048,576-token context advertised over 681,280-token KV pools,
with SGLang 0.5.8's leak bug switched on. The gateway's KV-pool gate measures the pools and clamps the model's limit
(config/demo.yaml sets `on_pool_mismatch: clamp`), so the leak cannot be reached through it.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from urllib.parse import urlsplit

from gateway.config import ModelConfig, load_config

ROOT = Path(__file__).resolve().parent.parent
DEMO_CONFIG = ROOT / "config" / "demo.yaml"
DEMO_POOL_TOKENS = 681_280


def run_demo(config_path: str | None) -> int:
    from gateway.cli import serve
    from loadtests.engine.harness import RunningEngine

    path = Path(config_path) if config_path else DEMO_CONFIG
    config = load_config(path)
    engines = [engine for model in config.models for engine in _engines_for(model, RunningEngine)]
    # uvicorn re-raises SIGTERM once it has shut down; turning it into SystemExit lets the engines stop below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        for engine in engines:
            engine.launch()
        for engine in engines:
            engine.wait_ready()
            print(f"kvgate demo: emulated {engine.role} engine at {engine.url} "
                  f"(KV pool {DEMO_POOL_TOKENS} tokens, SGLang 0.5.8 leak bug on)", flush=True)
        print(f"kvgate demo: gateway on http://{config.listen.host}:{config.listen.port} — try\n"
              f"  curl -s http://{config.listen.host}:{config.listen.port}/v1/chat/completions "
              "-H 'content-type: application/json' "
              "-d '{\"model\":\"glm-5\",\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}]}'", flush=True)
        return serve(str(path), "info")
    finally:
        for engine in engines:
            engine.stop()


def _engines_for(model: ModelConfig, engine_type: type) -> list:
    common = {"model": model.name, "pool_tokens": DEMO_POOL_TOKENS, "context_length": model.context_length,
              "tokenizer": str(model.tokenizer), "version": "0.5.8", "bug": True}
    if model.chat_template is not None:
        common["chat_template"] = str(model.chat_template)
    bootstrap_port = model.prefill[0].bootstrap_port or 8998
    engines = []
    for worker in model.prefill:
        parts = urlsplit(worker.url)
        engines.append(engine_type("prefill", parts.hostname, parts.port, worker.bootstrap_port or 8998, dict(common)))
    for worker in model.decode:
        parts = urlsplit(worker.url)
        engines.append(engine_type("decode", parts.hostname, parts.port, bootstrap_port, dict(common)))
    return engines
