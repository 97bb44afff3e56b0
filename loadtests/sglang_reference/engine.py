"""A real SGLang prefill/decode pair on this machine's CPU, for the `bin/test --sglang` tier
(tests/parity/test_sglang_engine.py): SGLang 0.5.8's own `sglang.launch_server`, unchanged, from the cached parity
venv (build.py), with the configs-only model directory (build.py: model_dir) and `--load-format dummy`: a one-layer
Llama with random weights and GLM-5's tokenizer and template. No weights are downloaded or read.

What it takes on a CPU, and why:
- `--device cpu`, `SGLANG_USE_CPU_ENGINE=1`, `--attention-backend torch_native`, `--sampling-backend pytorch`,
  `--disable-cuda-graph`, `--skip-server-warmup`: the CPU code paths SGLang has.
- `--disaggregation-transfer-backend mooncake` with the non-CUDA Mooncake wheel (`MOONCAKE` below) and
  `MC_FORCE_TCP=1`: SGLang 0.5.8 asks Mooncake for its `rdma` protocol, and Mooncake then uses its TCP transport
  instead; the KV cache is really sent from prefill to decode over loopback TCP. The wheel links libibverbs.so.1
  (Debian's `libibverbs1`; `bin/test --sglang` installs it) although no RDMA device is used. The wheel goes in its
  own folder beside the venvs, put on PYTHONPATH, so that the parity venvs (and their stamp) stay as built.
  The `fake` transfer backend is no way round: 0.5.8 has no KV manager or bootstrap server for it (it is a
  decode-only warm-up device), and 0.5.22/0.5.23 refuse it for a prefill server.
- `engine_stubs/torchao`: the model runner imports torchao even with no `--torchao-config` and returns before using
  it; torchao's wheel wants a CUDA torch.
- the parity venv's `stubs/` (sgl_kernel, torchvision), as the driver has them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loadtests.engine.harness import free_port
from loadtests.sglang_reference import build

VERSION = "0.5.8"
MOONCAKE = ("mooncake-transfer-engine-non-cuda==0.3.13.post1", "msgpack==1.2.4")
ENGINE_STUBS = build.HERE / "engine_stubs"
POOL_TOKENS = 4096          # --max-total-tokens: a small KV pool
CONTEXT_LENGTH = 16384      # --context-length: above the pool, as in the incident
STARTUP_TIMEOUT_S = float(os.environ.get("KVGATE_SGLANG_ENGINE_TIMEOUT", "300"))


class EngineUnavailable(Exception):
    """The engine cannot start on this machine; the message says why (the test skips with it)."""


def mooncake_dir() -> Path:
    return build.cache_root() / f"mooncake-{MOONCAKE[0].split('==')[1]}"


def ensure_mooncake(python: Path) -> Path:
    """The Mooncake wheel installed (once) in its own folder; EngineUnavailable when it cannot be."""
    target = mooncake_dir()
    stamp = target / ".kvgate-stamp"
    if not (stamp.is_file() and stamp.read_text() == "\n".join(MOONCAKE)):
        try:
            subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                            "--no-deps", "--upgrade", "--target", str(target), *MOONCAKE],
                           check=True, capture_output=True, text=True, timeout=600)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            raise EngineUnavailable(f"cannot install {' '.join(MOONCAKE)}: {getattr(exc, 'stderr', '') or exc}"
                                    ) from exc
        stamp.write_text("\n".join(MOONCAKE))
    try:
        ctypes.CDLL("libibverbs.so.1")
    except OSError as exc:
        raise EngineUnavailable("Mooncake's wheel needs libibverbs.so.1: install Debian's libibverbs1 "
                                f"(bin/test --sglang does, as root) ({exc})") from exc
    return target


@dataclass
class Engine:
    role: str
    url: str
    log: Path
    process: subprocess.Popen[bytes]
    bootstrap_port: int | None = None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Pair:
    prefill: Engine
    decode: Engine
    startup_s: float
    engines: list[Engine] = field(default_factory=list)

    def stop(self) -> None:
        for engine in (self.prefill, self.decode):
            _stop(engine.process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """The engine's own process group (it was started in a new session): its scheduler and detokenizer too."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=20)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


def engine_env(mooncake: Path) -> dict[str, str]:
    env = build.driver_env()
    env.update(PYTHONPATH=os.pathsep.join([str(ENGINE_STUBS), str(build.STUBS), str(mooncake)]),
               SGLANG_USE_CPU_ENGINE="1", MC_FORCE_TCP="1", GLOG_minloglevel="1")
    return env


def _command(python: Path, model: Path, port: int, role: str, bootstrap_port: int) -> list[str]:
    return [str(python), "-m", "sglang.launch_server", "--model-path", str(model), "--load-format", "dummy",
            "--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
            "--max-total-tokens", str(POOL_TOKENS), "--context-length", str(CONTEXT_LENGTH),
            "--disable-cuda-graph", "--skip-server-warmup", "--host", "127.0.0.1", "--port", str(port),
            "--disaggregation-mode", role, "--disaggregation-transfer-backend", "mooncake",
            "--disaggregation-bootstrap-port", str(bootstrap_port), "--log-level", "info"]


def start_pair(log_dir: Path, version: str = VERSION) -> Pair:
    """Start a prefill and a decode and wait until both answer /health; EngineUnavailable (with the log's tail)
    when either cannot."""
    try:  # built here when this file runs first (the parity test would build it anyway)
        python = build.build(version)
    except (subprocess.CalledProcessError, OSError) as exc:
        raise EngineUnavailable(f"the SGLang {version} venv cannot be built: {exc}") from exc
    mooncake = ensure_mooncake(python)
    model = build.model_dir()
    env = engine_env(mooncake)
    started = time.monotonic()
    engines = []
    bootstrap_port = free_port()
    for role in ("prefill", "decode"):
        port = free_port()
        log = log_dir / f"sglang-{role}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(_command(python, model, port, role, bootstrap_port), env=env, stdout=out,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        engines.append(Engine(role, f"http://127.0.0.1:{port}", log, process,
                              bootstrap_port if role == "prefill" else None))
    pair = Pair(engines[0], engines[1], 0.0)
    try:
        _wait_healthy(engines, started)
    except BaseException:
        pair.stop()
        raise
    pair.startup_s = time.monotonic() - started
    return pair


def _wait_healthy(engines: list[Engine], started: float) -> None:
    waiting = list(engines)
    while waiting:
        for engine in list(waiting):
            if engine.process.poll() is not None:
                raise EngineUnavailable(f"SGLang {engine.role} exited ({engine.process.returncode}) while starting:"
                                        f"\n{_tail(engine.log_text())}")
            try:
                if httpx.get(f"{engine.url}/health", timeout=5).status_code == 200:
                    waiting.remove(engine)
            except httpx.HTTPError:
                pass
        if waiting and time.monotonic() - started > STARTUP_TIMEOUT_S:
            raise EngineUnavailable(f"SGLang {waiting[0].role} did not answer /health within {STARTUP_TIMEOUT_S:.0f}"
                                    f" s:\n{_tail(waiting[0].log_text())}")
        time.sleep(0.5)


def _tail(text: str, lines: int = 25) -> str:
    kept = [line for line in text.splitlines() if "Ignore import error" not in line and "server_args=" not in line]
    return "\n".join(kept[-lines:])
