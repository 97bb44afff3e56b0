"""Event-loop lag: how late a timer fires. Every request's work shares one loop, so lag is every request's latency."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import Histogram

INTERVAL_S = 0.25


class LoopLagProbe:
    def __init__(self, histogram: Histogram) -> None:
        self._histogram = histogram
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvgate-loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(INTERVAL_S)
            self._histogram.observe(max(0.0, time.perf_counter() - before - INTERVAL_S))
