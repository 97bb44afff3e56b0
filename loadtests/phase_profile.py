"""Where kvgate's CPU goes per request, by phase: a sampling profiler inside the gateway process
(`python -m loadtests.bench --profile`).

A thread reads, every `INTERVAL_S`, the event-loop thread's own CPU clock and its Python stack: the CPU the loop
thread used since the last sample is charged to the phase its innermost kvgate (or framework) frame belongs to.
Statistical, as every sampling profiler is, but it charges CPU time, not wall time, so an idle loop costs nothing.
CPU the loop spends in C with no Python frame of its own above the loop (uvloop reading and writing sockets, timers)
is "event loop and sockets"; CPU of other threads (token-counting pools, provenance) is "other threads", the
process's CPU less the loop thread's. Nothing is added to the request path: the sampler only looks.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from types import FrameType

INTERVAL_S = 0.002

# (path fragment, phase), first match from the innermost frame outwards. Order matters only within one frame.
_PHASES: tuple[tuple[str, str], ...] = (
    ("/gateway/http/intake.py", "intake and body"),
    ("/gateway/http/body.py", "intake and body"),
    ("/gateway/admission/", "admission and count"),
    ("/gateway/tenancy/", "tenancy"),
    ("/routing/pools.py", "pick and lease"),
    ("/routing/policies/", "pick and lease"),
    ("/routing/workers.py", "pick and lease"),
    ("/routing/breaker.py", "pick and lease"),
    ("/routing/prefix_index/", "pick and lease"),
    ("/gateway/serving/flow.py", "pick and lease"),
    ("/routing/engines/", "engine client: connect, verify, read"),
    ("/gateway/pd/", "exchange and release"),
    ("/gateway/http/relay.py", "relay to the client"),
    ("/gateway/telemetry/", "access record and metrics"),
    ("/gateway/integrity/", "access record and metrics"),
    ("/gateway/serving/gateway.py", "access record and metrics"),
    ("/prometheus_client/", "access record and metrics"),
    ("/opentelemetry/", "access record and metrics"),
    ("/gateway/http/", "HTTP framework (ASGI, Starlette, uvicorn)"),
    ("/starlette/", "HTTP framework (ASGI, Starlette, uvicorn)"),
    ("/uvicorn/", "HTTP framework (ASGI, Starlette, uvicorn)"),
)
LOOP = "event loop and sockets"
OTHER_THREADS = "other threads"
PROFILER = "the profiler itself"  # not kvgate's: shown so the profile run's totals can be read
ORDER = ("intake and body", "admission and count", "tenancy", "pick and lease", "engine client: connect, verify, read",
         "exchange and release", "relay to the client", "access record and metrics",
         "HTTP framework (ASGI, Starlette, uvicorn)", LOOP, OTHER_THREADS, PROFILER)


# The frames that run the loop itself (uvloop's loop is C: the Python frame below every callback is the one that
# called run_until_complete). At or below one of them is the loop's own work, whatever module called it.
_BOTTOM = (("/asyncio/runners.py", "run"), ("/asyncio/base_events.py", "run_until_complete"),
           ("/asyncio/base_events.py", "run_forever"), ("/uvicorn/server.py", "run"))


def phase_of(frame: FrameType | None) -> str:
    while frame is not None:
        code = frame.f_code
        path = code.co_filename
        if any(path.endswith(file) and code.co_name == name for file, name in _BOTTOM):
            return LOOP
        for fragment, phase in _PHASES:
            if fragment in path:
                return phase
        frame = frame.f_back
    return LOOP


class PhaseSampler:
    """Samples the thread `thread_id` (the event loop's) from a daemon thread of its own."""

    def __init__(self, thread_id: int) -> None:
        self._thread_id = thread_id
        self._clock = time.pthread_getcpuclockid(thread_id)
        self._lock = threading.Lock()
        self._cpu: Counter[str] = Counter()
        self._process_cpu0 = time.process_time()
        self._loop_cpu0 = time.clock_gettime(self._clock)

    def start(self) -> None:
        threading.Thread(target=self._run, name="kvgate-phase-sampler", daemon=True).start()

    def _run(self) -> None:
        clock, thread_id = self._clock, self._thread_id
        last, own = time.clock_gettime(clock), time.thread_time()
        while True:
            time.sleep(INTERVAL_S)
            frame = sys._current_frames().get(thread_id)
            now = time.clock_gettime(clock)
            phase = phase_of(frame)
            del frame
            mine = time.thread_time()
            with self._lock:
                self._cpu[phase] += now - last
                self._cpu[PROFILER] += mine - own
            last, own = now, mine

    def take(self) -> dict[str, float]:
        """CPU seconds per phase since the last take (or the start), other threads included; then starts over."""
        with self._lock:
            cpu, self._cpu = self._cpu, Counter()
            process, loop = time.process_time(), time.clock_gettime(self._clock)
            others = (process - self._process_cpu0) - (loop - self._loop_cpu0) - cpu[PROFILER]
            cpu[OTHER_THREADS] = max(0.0, others)
            self._process_cpu0, self._loop_cpu0 = process, loop
        return dict(cpu)
