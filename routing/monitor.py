"""Watches every worker: reads its telemetry at startup (with retries) and then every health interval, and hands
each model's judgement to the gateway before the next request is admitted.

Reading `/server_info` doubles as the health check: it is cheap on SGLang (its `/health` may run a real generation),
and it is what reveals a restart with a different pool. A worker that cannot be read is out of rotation until a
read succeeds and passes the gate again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from gateway.config import HealthConfig, ModelConfig
from gateway.engines import EngineClient
from routing.gate import ModelJudgement, judge_model
from routing.pools import ModelPool
from routing.telemetry import Reading, read_worker
from routing.workers import Worker

log = logging.getLogger("kvgate.monitor")

OnJudgement = Callable[[ModelJudgement, bool], None]


class WorkerMonitor:
    def __init__(self, engines: EngineClient, models: list[tuple[ModelConfig, ModelPool]], health: HealthConfig,
                 on_judgement: OnJudgement) -> None:
        self._engines = engines
        self._models = models
        self._health = health
        self._on_judgement = on_judgement
        self._failures: dict[Worker, int] = {}
        self._successes: dict[Worker, int] = {}
        self._task: asyncio.Task[None] | None = None

    async def verify_startup(self, timeout_s: float) -> list[ModelJudgement]:
        """Read every worker, retrying unreachable ones with backoff until `timeout_s`, then judge each model."""
        deadline = time.monotonic() + timeout_s
        readings: dict[Worker, Reading] = {}
        backoff_s = 0.1
        while True:
            pending = [w for _, pool in self._models for w in pool.workers
                       if w not in readings or readings[w].telemetry is None]
            results = await asyncio.gather(*(self._read(w, with_metrics=True) for w in pending))
            readings.update(zip(pending, results))
            unreachable = [w for w in pending if readings[w].telemetry is None]
            remaining_s = deadline - time.monotonic()
            if not unreachable or remaining_s <= 0:
                break
            log.info("waiting for %d unreachable worker(s): %s", len(unreachable),
                     ", ".join(w.url for w in unreachable))
            await asyncio.sleep(min(backoff_s, remaining_s))
            backoff_s = min(backoff_s * 2, 2.0)
        judgements = []
        for config, pool in self._models:
            judgement = judge_model(config, {w: readings[w] for w in pool.workers}, startup=True)
            self._on_judgement(judgement, True)
            judgements.append(judgement)
        return judgements

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvgate-worker-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def poll_once(self) -> None:
        for config, pool in self._models:
            results = await asyncio.gather(*(self._read(w, with_metrics=False) for w in pool.workers))
            readings = dict(zip(pool.workers, results))
            for worker, reading in readings.items():
                self._count_health(worker, reading.telemetry is not None)
            self._on_judgement(judge_model(config, readings, startup=False), False)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._health.interval_s)
            try:
                await self.poll_once()
            except Exception:  # the monitor must outlive any one bad reading
                log.exception("worker monitor poll failed")

    async def _read(self, worker: Worker, *, with_metrics: bool) -> Reading:
        return await read_worker(self._engines, worker.url, timeout_s=self._health.timeout_s,
                                 with_metrics=with_metrics)

    def _count_health(self, worker: Worker, ok: bool) -> None:
        if ok:
            self._failures[worker] = 0
            self._successes[worker] = self._successes.get(worker, 0) + 1
            if not worker.healthy and self._successes[worker] >= self._health.success_threshold:
                worker.healthy = True
                log.info("worker %s is healthy again", worker.url)
        else:
            self._successes[worker] = 0
            self._failures[worker] = self._failures.get(worker, 0) + 1
            if worker.healthy and self._failures[worker] >= self._health.failure_threshold:
                worker.healthy = False
                log.warning("worker %s is unhealthy", worker.url)
