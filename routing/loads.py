"""Engines' own load, for power_of_two: polled on an interval from `/v1/loads` (SGLang 0.5.8+), falling back to the
deprecated `/get_load` (gone in 0.5.23). A worker that cannot be read keeps no load: a stale number is worse than
the gateway's own in-flight count, which the policy then uses."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from routing.engines.client import EngineClient
from routing.engines.errors import EngineError
from routing.workers import Worker

log = logging.getLogger("kvgate.loads")


def load_from_v1_loads(report: Any) -> int | None:
    """KV tokens in use plus tokens waiting, summed over data-parallel ranks."""
    loads = report.get("loads") if isinstance(report, dict) else None
    if not isinstance(loads, list) or not loads:
        return None
    total = 0
    for rank in loads:
        if not isinstance(rank, dict) or not isinstance(rank.get("num_used_tokens"), int):
            return None
        waiting = rank.get("num_waiting_uncached_tokens")
        total += rank["num_used_tokens"] + (waiting if isinstance(waiting, int) else 0)
    return total


def load_from_get_load(report: Any) -> int | None:
    """`num_tokens` summed over ranks, as sglang-router's LoadMonitor reads it."""
    if not isinstance(report, list) or not report:
        return None
    values = [rank.get("num_tokens") for rank in report if isinstance(rank, dict)]
    if len(values) != len(report) or not all(isinstance(v, int) for v in values):
        return None
    return sum(values)


async def read_load(engines: EngineClient, url: str, *, timeout_s: float) -> int | None:
    for path, parse in (("/v1/loads", load_from_v1_loads), ("/get_load", load_from_get_load)):
        try:
            load = parse(await engines.get_json(url, path, timeout_s=timeout_s))
        except EngineError:
            continue
        if load is not None:
            return load
    return None


class LoadPoller:
    def __init__(self, engines: EngineClient, workers: Callable[[], list[Worker]], *, interval_s: float) -> None:
        self._engines = engines
        self._workers = workers
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvgate-load-poller")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def poll_once(self) -> None:
        workers = [w for w in self._workers() if w.verified is not None]
        loads = await asyncio.gather(*(read_load(self._engines, w.url, timeout_s=self._interval_s) for w in workers))
        for worker, load in zip(workers, loads):
            if load is not None:
                worker.record_engine_load(load)

    async def _run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:  # keep polling whatever one reading did
                log.exception("load poll failed")
            await asyncio.sleep(self._interval_s)
