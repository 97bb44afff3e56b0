"""The gateway's own CPU cost per request: `python -m loadtests.gateway_bench`.

Starts two emulated SGLang PD pairs (loadtests.engine.harness) and kvgate in a process of its own
(`gateway.cli serve`, uvloop + httptools, exactly as deployed), then drives real HTTP on 127.0.0.1 from this
process (aiohttp, keep-alive, fixed concurrency, a fixed number of requests per phase, each phase time-bounded).

For each phase it reads the gateway process's CPU time (utime + stime of every thread, from /proc/<pid>/stat)
before and after, and reports gateway CPU seconds / requests, with nothing subtracted: background work (health
checks every 5 s, the lag probe below) is included. Two models are served:

    glm-5        decode with no token delay: the emulator writes the whole decode stream in one go, as for a
                 non-streaming engine answer (the fixed cost of a PD request)
    glm-5-paced  decode with --token-delay-ms 1: every token is its own SSE write, as from a real engine

Phases: non-streaming `/generate` and chat completion (glm-5), streamed 32-token chat completion (glm-5-paced,
the headline; and glm-5 for the burst case), and non-streaming chat on the paced decode. Every request asks for
32 output tokens and carries a distinct prompt (no token-count cache hits).

Event-loop lag: the gateway process is started through this module (`--serve`), which runs the function behind
`kvgate serve` (gateway.server.serve) unchanged after wrapping `uvicorn.Server.serve` to add one task that sleeps 10 ms in a loop and records how late
it wakes (timer overshoot, perf_counter). No gateway file is touched and nothing is added to the request path;
the probe costs ~100 wake-ups/s. uvloop timers have 1 ms granularity, so an idle loop already shows ~1 ms; the
idle baseline is printed next to the figure under load. `--plain` runs `python -m gateway.cli serve` itself (no
probe; loop lag n/a).

    python -m loadtests.gateway_bench                       # ~1 minute on 2 cores
    python -m loadtests.gateway_bench --scale 0.3           # quicker, noisier
    python -m loadtests.gateway_bench --profile /tmp/prof   # py-spy each phase (needs `pip install py-spy`)

Final lines (machine-readable): nonstream_cpu_ms_per_req=…, stream32_cpu_ms_per_req=…, loop_lag_p99_ms=….
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtests.engine.harness import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
GLM5_TOKENIZER = REPO_ROOT / "config/models/glm-5/tokenizer.json.gz"
GLM5_TEMPLATE = REPO_ROOT / "config/models/glm-5/chat_template.jinja"
CLK_TCK = os.sysconf("SC_CLK_TCK")
OUTPUT_TOKENS = 32
LAG_INTERVAL_S = 0.010
LAG_FILE_ENV = "KVGATE_BENCH_LAG_FILE"
# A ~90-token English prompt; each request appends its own number, so no two prompts are alike.
PROMPT = ("You are reviewing a pull request for a gateway that sits in front of prefill and decode engine pools. "
          "Summarise the change below in two sentences, then list any risk to latency or correctness you see, "
          "most serious first, and say whether it is safe to merge before the release freeze on Friday. "
          "Change number")


# ── the gateway process (--serve): gateway.server.serve plus a loop-lag probe ─────────────────────────────────────
def serve_with_lag_probe(config_path: str) -> int:
    """Run `kvgate serve` unchanged, with a timer-overshoot sampler on its event loop; SIGUSR1 dumps the samples
    as JSON [[monotonic_s, lag_s], ...] to $KVGATE_BENCH_LAG_FILE."""
    from array import array

    import uvicorn

    import logging

    from gateway.config import load_config
    from gateway.server import serve as serve_gateway

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

    async def serve(self: Any, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        task = loop.create_task(sampler())
        loop.add_signal_handler(signal.SIGUSR1, dump)
        try:
            return await original_serve(self, *args, **kwargs)
        finally:
            task.cancel()

    uvicorn.Server.serve = serve  # type: ignore[method-assign]
    # The function behind `kvgate serve`, called directly rather than through argument parsing; it builds the
    # uvicorn server exactly as the CLI does.
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve_gateway(load_config(config_path), log_level="warning")


# ── setup ─────────────────────────────────────────────────────────────────────────────────────────────────────
def write_config(directory: Path, pairs: dict[str, Any]) -> tuple[Path, int]:
    import yaml

    port = free_port()
    models = [{"name": name, "tokenizer": str(GLM5_TOKENIZER), "chat_template": str(GLM5_TEMPLATE),
               "context_length": 8192,
               "prefill": [{"url": pair.prefill.url, "bootstrap_port": pair.prefill.bootstrap_port}],
               "decode": [{"url": pair.decode.url}]}
              for name, pair in pairs.items()]
    document = {"listen": {"host": "127.0.0.1", "port": port}, "health": {"interval_s": 5},
                "gate": {"startup_timeout_s": 30.0}, "models": models}
    path = directory / "kvgate-bench.yaml"
    path.write_text(yaml.safe_dump(document))
    return path, port


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


def loop_thread_schedstat(pid: int) -> tuple[float, float]:
    """The main (event-loop) thread's on-CPU time and run-queue wait (ready but not running), in seconds."""
    with open(f"/proc/{pid}/task/{pid}/schedstat", "rb") as fh:
        on_cpu, waiting, _ = fh.read().split()
    return int(on_cpu) / 1e9, int(waiting) / 1e9


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


@dataclass
class Phase:
    name: str
    model: str
    route: str
    stream: bool
    requests: int
    label: str
    # filled in by run_phase
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    gateway_cpu_s: float = 0.0
    gateway_sys_s: float = 0.0
    loop_cpu_s: float = 0.0
    loop_runq_wait_s: float = 0.0
    engines_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    window: tuple[float, float] = (0.0, 0.0)

    @property
    def cpu_ms_per_req(self) -> float:
        return 1000 * self.gateway_cpu_s / max(1, self.ok + sum(self.errors.values()))


class Bench:
    def __init__(self, url: str, gateway_pid: int, engine_pids: list[int], concurrency: int,
                 phase_timeout_s: float, profile_dir: Path | None) -> None:
        self.url = url
        self.gateway_pid = gateway_pid
        self.engine_pids = engine_pids
        self.concurrency = concurrency
        self.phase_timeout_s = phase_timeout_s
        self.profile_dir = profile_dir
        self.counter = 0

    def body(self, phase: Phase) -> bytes:
        import orjson

        self.counter += 1
        prompt = f"{PROMPT} {self.counter}."
        if phase.route == "/generate":
            return orjson.dumps({"model": phase.model, "text": prompt, "stream": phase.stream,
                                 "sampling_params": {"max_new_tokens": OUTPUT_TOKENS, "temperature": 0}})
        return orjson.dumps({"model": phase.model, "stream": phase.stream, "max_tokens": OUTPUT_TOKENS,
                             "temperature": 0, "messages": [{"role": "user", "content": prompt}]})

    async def one(self, session: Any, phase: Phase, record: bool) -> None:
        import aiohttp

        start = time.perf_counter()
        try:
            async with session.post(self.url + phase.route, data=self.body(phase),
                                    headers={"Content-Type": "application/json"}) as response:
                payload = await response.read()
                status = response.status
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            if record:
                phase.errors[type(exc).__name__] = phase.errors.get(type(exc).__name__, 0) + 1
            return
        if not record:
            return
        problem = None
        if status != 200:
            problem = f"HTTP {status}"
        elif phase.stream:
            if not payload.endswith(b"data: [DONE]\n\n"):
                problem = "stream without [DONE]"
            elif payload.count(b"data: ") < OUTPUT_TOKENS:  # one event per token at least
                problem = "short stream"
        elif not payload.startswith(b"{") or (b'"error"' in payload[:20]):
            problem = "bad body"
        if problem:
            phase.errors[problem] = phase.errors.get(problem, 0) + 1
        else:
            phase.ok += 1
            phase.latencies.append(time.perf_counter() - start)

    async def drive(self, session: Any, phase: Phase, count: int, record: bool) -> None:
        remaining = count

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                await self.one(session, phase, record)

        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(self.concurrency))),
                               timeout=self.phase_timeout_s)

    async def run_phase(self, session: Any, phase: Phase) -> Phase:
        await self.drive(session, phase, self.concurrency * 2, record=False)  # warm connections and caches
        spy = self.start_profiler(phase)
        gateway0 = cpu_times(self.gateway_pid)
        loop0 = loop_thread_schedstat(self.gateway_pid)
        engines0 = sum(cpu_seconds(pid) for pid in self.engine_pids)
        client0 = time.process_time()
        mono0, wall0 = time.monotonic(), time.perf_counter()
        try:
            await self.drive(session, phase, phase.requests, record=True)
        except asyncio.TimeoutError:
            phase.errors["phase timeout"] = phase.requests - phase.ok - sum(phase.errors.values())
        phase.wall_s = time.perf_counter() - wall0
        phase.window = (mono0, time.monotonic())
        gateway1 = cpu_times(self.gateway_pid)
        phase.gateway_cpu_s = sum(gateway1) - sum(gateway0)
        phase.gateway_sys_s = gateway1[1] - gateway0[1]
        loop1 = loop_thread_schedstat(self.gateway_pid)
        phase.loop_cpu_s, phase.loop_runq_wait_s = loop1[0] - loop0[0], loop1[1] - loop0[1]
        phase.engines_cpu_s = sum(cpu_seconds(pid) for pid in self.engine_pids) - engines0
        phase.client_cpu_s = time.process_time() - client0
        self.stop_profiler(spy)
        return phase

    def start_profiler(self, phase: Phase) -> subprocess.Popen[bytes] | None:
        if self.profile_dir is None:
            return None
        py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        out = self.profile_dir / f"{phase.name}.txt"
        spy = subprocess.Popen([py_spy, "record", "--pid", str(self.gateway_pid), "--rate", "250", "--format",
                                "raw", "--gil", "-o", str(out), "--duration", "300"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # let it attach
        return spy

    @staticmethod
    def stop_profiler(spy: subprocess.Popen[bytes] | None) -> None:
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            try:
                spy.wait(timeout=20)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait()


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise RuntimeError("gateway did not become ready")


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


async def run_load(bench: Bench, phases: list[Phase]) -> None:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=bench.concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
        for phase in phases:
            await bench.run_phase(session, phase)
            print(f"  {phase.name:<18} {phase.ok}/{phase.requests} ok in {phase.wall_s:.1f}s", flush=True)


def build_phases(scale: float) -> list[Phase]:
    def n(count: int) -> int:
        return max(50, int(count * scale))

    return [
        Phase("generate", "glm-5", "/generate", False, n(3000), "non-stream /generate (burst decode)"),
        Phase("chat", "glm-5", "/v1/chat/completions", False, n(2000), "non-stream chat (burst decode)"),
        Phase("chat_stream32", "glm-5-paced", "/v1/chat/completions", True, n(2000),
              "stream chat, 32 tok, 1/write"),
        Phase("chat_stream32_burst", "glm-5", "/v1/chat/completions", True, n(1500), "stream chat, 32 tok, burst"),
        Phase("chat_paced", "glm-5-paced", "/v1/chat/completions", False, n(1500), "non-stream chat, 32 tok paced"),
    ]


def report(phases: list[Phase], idle_cpu_ms_per_s: float, idle_lags: list[float],
           stamps: list[float], lags: list[float], have_probe: bool) -> None:
    print()
    header = (f"{'phase':<32} {'ok':>5} {'err':>3} {'req/s':>6} {'gw CPU':>7} {'loop thr':>8} {'gw':>5} {'sys':>4} "
              f"{'runq':>5} {'engines':>7} {'client':>6} {'p50':>6} {'p99':>6} {'lag':>6} {'lag':>6}")
    units = (f"{'':<32} {'':>5} {'':>3} {'':>6} {'ms/req':>7} {'ms/req':>8} {'cores':>5} {'%':>4} "
             f"{'ms/s':>5} {'ms/req':>7} {'ms/req':>6} {'ms':>6} {'ms':>6} {'p99 ms':>6} {'max ms':>6}")
    print(header)
    print(units)
    print("-" * len(header))
    all_load_lags: list[float] = []
    for phase in phases:
        done = max(1, phase.ok + sum(phase.errors.values()))
        window_lags = lags_within(stamps, lags, phase.window) if have_probe else []
        all_load_lags += window_lags
        lag99 = f"{1000 * percentile(window_lags, 99):6.2f}" if window_lags else f"{'n/a':>6}"
        lagmax = f"{1000 * max(window_lags):6.2f}" if window_lags else f"{'n/a':>6}"
        print(f"{phase.label:<32} {phase.ok:>5} {sum(phase.errors.values()):>3} {phase.ok / phase.wall_s:>6.0f} "
              f"{phase.cpu_ms_per_req:>7.3f} {1000 * phase.loop_cpu_s / done:>8.3f} "
              f"{phase.gateway_cpu_s / phase.wall_s:>5.2f} "
              f"{100 * phase.gateway_sys_s / max(phase.gateway_cpu_s, 1e-9):>4.0f} {1000 * phase.loop_runq_wait_s / phase.wall_s:>5.0f} "
              f"{1000 * phase.engines_cpu_s / done:>7.3f} {1000 * phase.client_cpu_s / done:>6.3f} "
              f"{1000 * percentile(phase.latencies, 50):>6.1f} {1000 * percentile(phase.latencies, 99):>6.1f} "
              f"{lag99} {lagmax}")
        if phase.errors:
            print(f"    errors: {phase.errors}")
    print()
    print("gw CPU: all gateway threads (/proc stat), sys %: its kernel share; loop thr: the event-loop thread "
          "alone (schedstat); "
          "runq: time the loop thread sat ready but not running, per second (CPU contention from the other "
          "processes, which feeds loop lag)")
    print(f"gateway idle CPU: {idle_cpu_ms_per_s:.2f} ms/s (health checks + lag probe; included above, not "
          f"subtracted)")
    if have_probe and idle_lags:
        print(f"loop lag idle baseline: p99 {1000 * percentile(idle_lags, 99):.2f} ms "
              f"(uvloop timers tick in 1 ms steps)")
    print("targets: <= 0.5 ms gateway CPU per non-streaming PD request, <= 1 ms per streamed 32-token completion "
          "(SGLang's Rust router: 0.09 / 0.27 ms)")
    print(f"machine: {os.cpu_count()} cores; gateway, both engine pairs and this client share them")
    print()
    by_name = {phase.name: phase for phase in phases}
    print(f"nonstream_cpu_ms_per_req={by_name['generate'].cpu_ms_per_req:.3f}")
    print(f"nonstream_chat_cpu_ms_per_req={by_name['chat'].cpu_ms_per_req:.3f}")
    print(f"stream32_cpu_ms_per_req={by_name['chat_stream32'].cpu_ms_per_req:.3f}")
    lag = f"{1000 * percentile(all_load_lags, 99):.3f}" if all_load_lags else "n/a"
    print(f"loop_lag_p99_ms={lag}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.gateway_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every phase's request count")
    parser.add_argument("--phase-timeout-s", type=float, default=25.0)
    parser.add_argument("--plain", action="store_true",
                        help="run `python -m gateway.cli serve` without the loop-lag probe")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="py-spy record the gateway during each phase into DIR/<phase>.txt (collapsed "
                             "stacks); py-spy pauses the process to sample, so figures of a profiled run are not "
                             "the bench's figures")
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)  # internal: the gateway process
    args = parser.parse_args(argv)
    if args.serve:
        return serve_with_lag_probe(args.serve)

    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    from loadtests.engine.harness import start_pair

    began = time.monotonic()
    load1 = os.getloadavg()[0]
    if load1 > 0.5:
        print(f"note: load average is {load1:.1f} before the bench starts; other processes share the cores",
              flush=True)
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    pairs: dict[str, Any] = {}
    gateway: subprocess.Popen[bytes] | None = None
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp:
        workdir = Path(tmp)
        try:
            print("starting engines (2 PD pairs) ...", flush=True)
            common = dict(prefill_pool=65536, decode_pool=65536, context_length=8192, bug=False, model="glm-5",
                          version="0.5.23", first_token_delay_ms=0)
            # Started one pair after the other: four tokenizer loads at once on 2 cores is no faster.
            pairs["glm-5"] = start_pair(**common, token_delay_ms=0)
            pairs["glm-5-paced"] = start_pair(**common, token_delay_ms=1)
            config_path, port = write_config(workdir, pairs)
            lag_file = workdir / "lags.json"
            env = {**os.environ, LAG_FILE_ENV: str(lag_file),
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
            if args.plain:
                command = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config_path),
                           "--log-level", "warning"]
            else:
                command = [sys.executable, "-m", "loadtests.gateway_bench", "--serve", str(config_path)]
            print("starting gateway ...", flush=True)
            gateway = subprocess.Popen(command, cwd=REPO_ROOT, env=env)
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, gateway, timeout_s=60)

            engine_pids = [eng.proc.pid for pair in pairs.values() for eng in (pair.prefill, pair.decode)]
            bench = Bench(url, gateway.pid, engine_pids, args.concurrency, args.phase_timeout_s, args.profile)
            idle0, idle_mono0 = threads_cpu_seconds(gateway.pid), time.monotonic()
            time.sleep(2.0)
            idle_window = (idle_mono0, time.monotonic())
            idle_cpu_ms_per_s = 1000 * (threads_cpu_seconds(gateway.pid) - idle0) / (idle_window[1] - idle_window[0])

            phases = build_phases(args.scale)
            print(f"load: concurrency {args.concurrency}, {OUTPUT_TOKENS} output tokens per request", flush=True)
            asyncio.run(run_load(bench, phases))

            stamps, lags = ([], []) if args.plain else read_lags(gateway, lag_file)
            idle_lags = lags_within(stamps, lags, idle_window)
            report(phases, idle_cpu_ms_per_s, idle_lags, stamps, lags, have_probe=bool(stamps))
            print(f"(bench took {time.monotonic() - began:.0f}s)")
        finally:
            if gateway is not None and gateway.poll() is None:
                gateway.send_signal(signal.SIGTERM)
                try:
                    gateway.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    gateway.kill()
                    gateway.wait()
            for pair in pairs.values():
                pair.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
