"""Watches every worker: reads its telemetry at startup (with retries), then every health interval and whenever a
worker drops out pending re-verification; applies the KV-pool gate's verdicts to the workers and hands each
model's judgement to the gateway before the next request is admitted.

Reading `/server_info` doubles as the health check: it is cheap on SGLang (its `/health` may run a real generation),
and it is what reveals a restart with a different pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from routing.engine_info import Reading, read_worker
from routing.engines.client import EngineClient
from routing.gate import ModelJudgement, judge_model
from routing.pools import ModelPool
from routing.specs import HealthSpec, ModelSpec
from routing.workers import Worker

log = logging.getLogger("kvgate.monitor")

OnJudgement = Callable[[ModelJudgement, bool], None]
# Shortest pause between two on-demand reads, so a worker that keeps dropping out cannot make the monitor spin.
_MIN_REREAD_S = 0.05


class WorkerMonitor:
    def __init__(self, engines: EngineClient, models: list[tuple[ModelSpec, ModelPool]], health: HealthSpec,
                 on_judgement: OnJudgement) -> None:
        self._engines = engines
        self._models = models
        self._health = health
        self._on_judgement = on_judgement
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        for _, pool in models:
            for worker in pool.workers:
                worker.on_needs_verification(lambda _: self._wake.set())

    async def verify_startup(self, timeout_s: float) -> list[ModelJudgement]:
        """Read every worker, retrying unreachable ones with backoff until `timeout_s`, then judge each model."""
        deadline = time.monotonic() + timeout_s
        readings: dict[Worker, Reading] = {}
        backoff_s = 0.1
        while True:
            pending = [w for _, pool in self._models for w in pool.workers
                       if w not in readings or readings[w].info is None]
            results = await asyncio.gather(*(self._read(w, with_metrics=True) for w in pending))
            readings.update(zip(pending, results))
            unreachable = [w for w in pending if readings[w].info is None]
            remaining_s = deadline - time.monotonic()
            if not unreachable or remaining_s <= 0:
                break
            log.info("waiting for %d unreachable worker(s): %s", len(unreachable),
                     ", ".join(w.url for w in unreachable))
            await asyncio.sleep(min(backoff_s, remaining_s))
            backoff_s = min(backoff_s * 2, 2.0)
        return [self._judge(spec, {w: readings[w] for w in pool.workers}, startup=True)
                for spec, pool in self._models]

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvgate-worker-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def poll_once(self) -> None:
        for spec, pool in self._models:
            results = await asyncio.gather(*(self._read(w, with_metrics=False) for w in pool.workers))
            readings = dict(zip(pool.workers, results))
            for worker, reading in readings.items():
                worker.record_health(reading.info is not None, failure_threshold=self._health.failure_threshold,
                                     success_threshold=self._health.success_threshold)
            self._judge(spec, readings, startup=False)

    def _judge(self, spec: ModelSpec, readings: dict[Worker, Reading], *, startup: bool) -> ModelJudgement:
        """Judge a model, apply each verdict to its worker, then let the gateway follow (limits, metrics)."""
        judgement = judge_model(spec, readings, startup=startup)
        for verdict in judgement.workers:
            info = verdict.reading.info
            if verdict.problems or info is None:
                verdict.worker.refuse("; ".join(verdict.problems) or "not readable")
            else:
                verdict.worker.accept(info.identity)
        self._on_judgement(judgement, startup)
        return judgement

    async def _run(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self._health.interval_s):
                    await self._wake.wait()
                await asyncio.sleep(_MIN_REREAD_S)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.poll_once()
            except Exception:  # the monitor must outlive any one bad reading
                log.exception("worker monitor poll failed")

    async def _read(self, worker: Worker, *, with_metrics: bool) -> Reading:
        return await read_worker(self._engines, worker.url, timeout_s=self._health.timeout_s,
                                 with_metrics=with_metrics)
