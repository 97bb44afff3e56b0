"""What a benchmark reads about the processes it measures (Linux /proc), and the gateway's loop-lag probe."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
GLM5_TOKENIZER = REPO_ROOT / "config/models/glm-5/tokenizer.json.gz"
GLM5_TEMPLATE = REPO_ROOT / "config/models/glm-5/chat_template.jinja"
CLK_TCK = os.sysconf("SC_CLK_TCK")
LAG_INTERVAL_S = 0.010
LAG_FILE_ENV = "KVGATE_BENCH_LAG_FILE"
PROFILE_FILE_ENV = "KVGATE_BENCH_PROFILE_FILE"  # set: the phase profiler runs; SIGUSR2 writes and resets it


def cpu_times(pid: int) -> tuple[float, float]:
    """(utime, stime) of the whole process (all threads, live and exited), in seconds."""
    with open(f"/proc/{pid}/stat", "rb") as fh:
        fields = fh.read().rsplit(b")", 1)[1].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def cpu_seconds(pid: int) -> float:
    return sum(cpu_times(pid))


def threads_cpu_seconds(pid: int) -> float:
    """On-CPU time of the live threads, nanosecond-precise (schedstat); for short idle windows."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as fh:
                total += int(fh.read().split()[0])
        except FileNotFoundError:
            pass
    return total / 1e9


def peak_rss_mib(pid: int) -> float:
    """The process's high-water resident set."""
    return _status_mib(pid, "VmHWM:")


def rss_mib(pid: int) -> float:
    return _status_mib(pid, "VmRSS:")


def _status_mib(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return float("nan")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 20) -> None:
    """SIGTERM (a gateway drains and exits), then SIGKILL if it has not exited within `timeout_s`."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float, path: str = "/readyz") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + path, timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become ready")


# ── the gateway process with a loop-lag probe ─────────────────────────────────────────────────────────────────
def serve_with_lag_probe(config_path: str) -> int:
    """Run `kvgate serve` unchanged, with a timer-overshoot sampler on its event loop; SIGUSR1 dumps the samples
    as JSON [[monotonic_s...], [lag_s...]] to $KVGATE_BENCH_LAG_FILE. Nothing is added to the request path."""
    import logging
    from array import array

    import uvicorn

    from gateway.commands.supervisor import serve as serve_gateway
    from gateway.config import load_config

    lag_file = os.environ[LAG_FILE_ENV]
    original_serve = uvicorn.Server.serve
    stamps, lags = array("d"), array("d")

    async def sampler() -> None:
        perf, mono = time.perf_counter, time.monotonic
        while True:
            start = perf()
            await asyncio.sleep(LAG_INTERVAL_S)
            lags.append(perf() - start - LAG_INTERVAL_S)
            stamps.append(mono())

    def dump() -> None:
        tmp = lag_file + ".tmp"
        with open(tmp, "w") as fh:
            json.dump([list(stamps), list(lags)], fh)
        os.replace(tmp, lag_file)

    profile_file = os.environ.get(PROFILE_FILE_ENV)

    async def serve(self: Any, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        task = loop.create_task(sampler())
        loop.add_signal_handler(signal.SIGUSR1, dump)
        if profile_file:
            import threading

            from loadtests.phase_profile import PhaseSampler

            phases = PhaseSampler(threading.get_ident())
            phases.start()

            def dump_profile() -> None:
                with open(profile_file + ".tmp", "w") as fh:
                    json.dump(phases.take(), fh)
                os.replace(profile_file + ".tmp", profile_file)

            loop.add_signal_handler(signal.SIGUSR2, dump_profile)
        try:
            return await original_serve(self, *args, **kwargs)
        finally:
            task.cancel()

    uvicorn.Server.serve = serve  # type: ignore[method-assign]
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve_gateway(load_config(config_path), log_level="warning")


def read_lags(proc: subprocess.Popen[bytes], lag_file: Path) -> tuple[list[float], list[float]]:
    lag_file.unlink(missing_ok=True)
    proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 5
    while not lag_file.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    if not lag_file.exists():
        return [], []
    stamps, lags = json.loads(lag_file.read_text())
    return stamps, lags


def lags_within(stamps: list[float], lags: list[float], window: tuple[float, float]) -> list[float]:
    return [lag for stamp, lag in zip(stamps, lags) if window[0] <= stamp <= window[1]]


def take_profile(proc: subprocess.Popen[bytes], profile_file: Path) -> dict[str, float]:
    """The gateway's CPU seconds per phase since the last call (loadtests.phase_profile)."""
    profile_file.unlink(missing_ok=True)
    proc.send_signal(signal.SIGUSR2)
    deadline = time.monotonic() + 5
    while not profile_file.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return json.loads(profile_file.read_text()) if profile_file.exists() else {}
