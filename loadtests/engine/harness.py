"""Start emulated SGLang servers as processes of their own (forked warm, see forked.py), for tests and benchmarks.

    from loadtests.engine.harness import start_engine, start_pair

    with start_pair(prefill_pool=4096, decode_pool=8192, context_length=16384, bug=True) as pair:
        body = {"text": "hi", **pair.bootstrap_fields(room=7)}
        # POST body to pair.prefill.url + "/generate" and pair.decode.url + "/generate" at the same time

    eng = start_engine("decode", pool_tokens=4096, context_length=8192, token_delay_ms=5)
    eng.restart(pool_tokens=1024)        # same ports, new options (e.g. "worker restarted with a smaller pool")
    eng.stop()

Every keyword not named below becomes a CLI flag: `token_delay_ms=5` -> `--token-delay-ms 5`, `bug=False` ->
`--no-bug`, `enable_metrics=True` -> `--enable-metrics`. The GLM-5 tokenizer shipped in config/models/glm-5 is
the default; HF_HUB_OFFLINE=1 is always set for the child.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import TimeoutExpired
from typing import TYPE_CHECKING, Any, TypeVar

from .forked import ForkedEngineProcess

if TYPE_CHECKING:
    import aiohttp

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TOKENIZER = str(REPO_ROOT / "config" / "models" / "glm-5" / "tokenizer.json.gz")
DEFAULT_MODEL = "glm-5-emu"
T = TypeVar("T")
_READY_PREFIX = "kvgate-engine ready"


_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now, chosen *below* the kernel's ephemeral range.

    A port from bind-to-0 lies in the ephemeral range, so between our check and the engine's own bind any
    outgoing connection on the machine may take it (seen in CI as EADDRINUSE). Ports below the range are
    never handed to outgoing connections; we also never hand the same one out twice in one process."""
    low, _ = _ephemeral_range()
    floor = 10_000 if low > 12_000 else 1_024
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(floor, low)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port found in {floor}..{low - 1}")


class PortTaken(RuntimeError):
    """Another process bound the engine's port between our check and its bind."""


def _on_fresh_ports(start: Callable[[], T], attempts: int = 3) -> T:
    for attempt in range(attempts):
        try:
            return start()
        except PortTaken:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _flags(opts: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for key, value in opts.items():
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):  # a JSON flag, e.g. default_chat_template_kwargs={"enable_thinking": False}
            out += [flag, json.dumps(value)]
        elif isinstance(value, (list, tuple)):  # a repeatable flag, e.g. env=["A=1", "B=2"]
            for item in value:
                out += [flag, str(item)]
        else:
            out += [flag, str(value)]
    return out


@dataclass
class RunningEngine:
    """One emulator process. `url` is its HTTP base URL; a prefill also has a bootstrap server on `bootstrap_port`."""

    role: str
    host: str
    port: int
    bootstrap_port: int
    opts: dict[str, Any]
    startup_timeout_s: float = 60.0
    proc: ForkedEngineProcess | None = field(default=None, repr=False)
    ready_line: str = ""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def arguments(self) -> list[str]:
        """The command-line arguments of `python -m loadtests.engine` for this engine."""
        return ["--role", self.role, "--host", self.host, "--port", str(self.port),
                "--bootstrap-port", str(self.bootstrap_port), *_flags(self.opts)]

    def start(self) -> RunningEngine:
        """Launch and block until the ready line; raises RuntimeError with the child's stderr on failure."""
        self.launch()
        return self.wait_ready()

    def launch(self) -> None:
        """Start the process without waiting (see wait_ready): `python -m loadtests.engine` with `arguments()`,
        forked from a warm process (see forked.py)."""
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
        self.proc = ForkedEngineProcess(self.arguments(), env, str(REPO_ROOT))

    def wait_ready(self) -> RunningEngine:
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + self.startup_timeout_s
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                line = self.proc.stdout.readline()
                if line.startswith(_READY_PREFIX):
                    self.ready_line = line.strip()
                    return self
            if self.proc.poll() is not None:
                break
        err = self._kill_and_collect()
        error = PortTaken if "address already in use" in err else RuntimeError
        raise error(f"engine {self.role} on port {self.port} did not become ready: {err}")

    def _kill_and_collect(self) -> str:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.kill()
        _, err = self.proc.communicate(timeout=10)
        return (err or "").strip()[-4000:]

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM and wait (SIGKILL after `timeout_s`); returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        code = self.proc.returncode
        self.proc = None
        return code

    def restart(self, **changed_opts: Any) -> RunningEngine:
        """Stop, then start again on the same ports with `changed_opts` merged into the options."""
        self.stop()
        self.opts = {**self.opts, **changed_opts}
        return self.start()

    def __enter__(self) -> RunningEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_engine(role: str, *, pool_tokens: int, context_length: int, bug: bool = True,
                 host: str = "127.0.0.1", port: int | None = None, bootstrap_port: int | None = None,
                 model: str = DEFAULT_MODEL, tokenizer: str = DEFAULT_TOKENIZER, startup_timeout_s: float = 60.0,
                 **opts: Any) -> RunningEngine:
    """Start one engine (free loopback ports unless given) and wait until it is ready."""
    def start() -> RunningEngine:
        eng = RunningEngine(role=role, host=host, port=port or free_port(host),
                            bootstrap_port=bootstrap_port or free_port(host),
                            opts={"model": model, "pool_tokens": pool_tokens, "context_length": context_length,
                                  "tokenizer": tokenizer, "bug": bug, **opts},
                            startup_timeout_s=startup_timeout_s)
        return eng.start()

    return start() if port and bootstrap_port else _on_fresh_ports(start)


@dataclass
class EnginePair:
    """A prefill and a decode; the decode's default bootstrap port is the prefill's."""

    prefill: RunningEngine
    decode: RunningEngine

    def bootstrap_fields(self, room: int) -> dict[str, Any]:
        """The fields a PD router injects into both halves of one request."""
        return {"bootstrap_host": self.prefill.host, "bootstrap_port": self.prefill.bootstrap_port,
                "bootstrap_room": room}

    def stop(self) -> None:
        self.decode.stop()
        self.prefill.stop()

    def __enter__(self) -> EnginePair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_pair(*, prefill_pool: int, decode_pool: int, context_length: int, bug: bool = True,
               prefill_opts: dict[str, Any] | None = None, decode_opts: dict[str, Any] | None = None,
               **common: Any) -> EnginePair:
    """Start a prefill and a decode in parallel (startup is mostly tokenizer loading) and wait for both."""
    host = common.pop("host", "127.0.0.1")
    base = {"model": common.pop("model", DEFAULT_MODEL), "tokenizer": common.pop("tokenizer", DEFAULT_TOKENIZER),
            "context_length": context_length, "bug": bug, **common}

    def start() -> EnginePair:
        bootstrap_port = free_port(host)
        prefill = RunningEngine("prefill", host, free_port(host), bootstrap_port,
                                {**base, "pool_tokens": prefill_pool, **(prefill_opts or {})})
        decode = RunningEngine("decode", host, free_port(host), bootstrap_port,
                               {**base, "pool_tokens": decode_pool, **(decode_opts or {})})
        started: list[RunningEngine] = []
        try:
            for eng in (prefill, decode):
                eng.launch()
                started.append(eng)
            for eng in started:
                eng.wait_ready()
        except BaseException:
            for eng in started:
                eng.stop()
            raise
        return EnginePair(prefill, decode)

    return _on_fresh_ports(start)


async def naive_pd_request(session: aiohttp.ClientSession, pair: EnginePair, path: str, body: dict[str, Any],
                           room: int, **kwargs: Any) -> tuple[tuple[int, bytes], tuple[int, bytes]]:
    """Send both halves at once with the same room, as sglang-router and MiniLB do; returns
    ((prefill_status, prefill_body), (decode_status, decode_body))."""
    import asyncio

    full = {**body, **pair.bootstrap_fields(room)}

    async def one(url: str) -> tuple[int, bytes]:
        async with session.post(url + path, json=full, **kwargs) as r:
            return r.status, await r.read()

    p, d = await asyncio.gather(one(pair.prefill.url), one(pair.decode.url))
    return p, d
