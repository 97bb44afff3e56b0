"""Run a real kvgate (uvicorn on loopback, in a thread of the test process) against emulated engines."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
import uvloop
import yaml

from gateway.config import load_config
from gateway.http.app import create_app
from gateway.http.server import uvicorn_config
from gateway.serving.gateway import Gateway
from gateway.telemetry.logs import JsonLines
from loadtests.engine.harness import RunningEngine, free_port, start_engine, start_pair

ROOT = Path(__file__).resolve().parent.parent
GLM5_TOKENIZER = ROOT / "config/models/glm-5/tokenizer.json.gz"
GLM5_TEMPLATE = ROOT / "config/models/glm-5/chat_template.jinja"


def model_entry(name: str, prefill: list[Any], decode: list[Any], **overrides: Any) -> dict[str, Any]:
    """A model block for engines started by the emulator harness (objects with .url and .bootstrap_port)."""
    entry = {
        "name": name, "tokenizer": str(GLM5_TOKENIZER), "chat_template": str(GLM5_TEMPLATE),
        "context_length": 8192,
        "prefill": [{"url": e.url, "bootstrap_port": e.bootstrap_port} for e in prefill],
        "decode": [{"url": e.url} for e in decode],
    }
    entry.update(overrides)
    return entry


def write_config(directory: Path, models: list[dict[str, Any]], **overrides: Any) -> Path:
    document: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": free_port()},
        # Two reads in a row before a worker is judged unhealthy: one slow read on a loaded CI machine is not an outage.
        "health": {"interval_s": 0.2, "timeout_s": 5.0, "failure_threshold": 2, "success_threshold": 1},
        "gate": {"startup_timeout_s": 5.0},
        "models": models,
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(document.get(key), dict):
            document[key] = {**document[key], **value}
        else:
            document[key] = value
    path = directory / f"kvgate-{document['listen']['port']}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


class RunningGateway:
    def __init__(self, server: uvicorn.Server, gateway: Gateway, thread: threading.Thread, port: int) -> None:
        self.server = server
        self.gateway = gateway
        self.thread = thread
        self.url = f"http://127.0.0.1:{port}"

    def call(self, function: Any, *args: Any) -> Any:
        """Run `function(*args)` on the gateway's event loop and return its result (for poking at state)."""
        loop = self.server_loop
        future = asyncio.run_coroutine_threadsafe(_call(function, *args), loop)
        return future.result(timeout=10)

    @property
    def server_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


async def _call(function: Any, *args: Any) -> Any:
    result = function(*args)
    if asyncio.iscoroutine(result):
        result = await result
    return result


@contextmanager
def running_gateway(config_path: Path) -> Iterator[RunningGateway]:
    gateway = start_gateway(config_path)
    try:
        yield gateway
    finally:
        gateway.stop()


def start_gateway(config_path: Path, *, timeout_s: float = 30.0) -> RunningGateway:
    """Start kvgate; raises RuntimeError (with the startup error) when it does not come up."""
    config = load_config(config_path)
    gateway = Gateway(config, config_path=config_path)
    app = create_app(config, gateway)
    server = uvicorn.Server(uvicorn_config(app, config, log_level="warning", loop="asyncio"))
    errors: list[BaseException] = []
    holder: dict[str, asyncio.AbstractEventLoop] = {}

    def serve() -> None:
        loop = uvloop.new_event_loop()  # as deployed
        holder["loop"] = loop
        try:
            loop.run_until_complete(server.serve())
        except BaseException as exc:  # SystemExit from a failed lifespan included
            errors.append(exc)
        finally:
            loop.close()

    thread = threading.Thread(target=serve, name="kvgate-test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            thread.join(timeout=5)
            raise RuntimeError(f"gateway did not start: {errors or 'timeout'}")
        time.sleep(0.02)
    running = RunningGateway(server, gateway, thread, config.listen.port)
    running._loop = holder["loop"]
    return running


@dataclass
class Trio:
    """One prefill and two decodes that all bootstrap from it."""

    prefill: RunningEngine
    decodes: list[RunningEngine]

    def stop(self) -> None:
        for engine in [*self.decodes, self.prefill]:
            engine.stop()

    def __enter__(self) -> Trio:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_trio(**options: Any) -> Trio:
    pair = start_pair(prefill_pool=20000, decode_pool=20000, context_length=8192, model="glm-5", version="0.5.23",
                      **options)
    try:
        second = start_engine("decode", pool_tokens=20000, context_length=8192, model="glm-5", version="0.5.23",
                              bootstrap_port=pair.prefill.bootstrap_port, **options)
    except BaseException:
        pair.stop()
        raise
    return Trio(pair.prefill, [pair.decode, second])


@contextmanager
def access_log_lines() -> Iterator[list[str]]:
    """The access log's lines (JSON) while the block runs, from any gateway in this process."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    handler = Collect()
    handler.setFormatter(JsonLines())
    access = logging.getLogger("kvgate.access")
    level = access.level
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        access.removeHandler(handler)
        access.setLevel(level)
