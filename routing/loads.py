"""Engines' own load, for power_of_two and kv_headroom: polled on an interval from `/v1/loads` (SGLang 0.5.8+), falling
back to the deprecated `/get_load` (gone in 0.5.23). A worker that cannot be read keeps no load: a stale number is
worse than the gateway's own in-flight count, which the policy then uses."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from routing.engine_load import EngineLoad, load_from_get_load, load_from_v1_loads
from routing.engines.client import EngineClient
from routing.engines.errors import EngineError
from routing.workers import Worker

log = logging.getLogger("kvgate.loads")


async def read_load(engines: EngineClient, url: str, *, timeout_s: float) -> EngineLoad | None:
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
