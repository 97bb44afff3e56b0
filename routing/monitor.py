"""Watches every worker: reads its telemetry at startup (with retries), then every health interval of its model and
whenever a worker drops out pending re-verification; applies the KV-pool gate's verdicts to the workers and hands
each model's judgement to the gateway before the next request is admitted.

Reading `/server_info` doubles as the health check: it is cheap on SGLang (its `/health` may run a real generation),
and it is what reveals a restart with a different pool. A model may name another health path; it is then fetched
too, and a worker is healthy only while both answer.
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


Watched = tuple[ModelSpec, ModelPool, HealthSpec]


class WorkerMonitor:
    def __init__(self, engines: EngineClient, models: list[Watched], on_judgement: OnJudgement) -> None:
        self._engines = engines
        self._models = models
        self._on_judgement = on_judgement
        self._tasks: list[asyncio.Task[None]] = []
        self._wake = {spec.name: asyncio.Event() for spec, _, _ in models}
        # One read-and-judge at a time per model: a poll that started before a worker was added must not finish
        # after the one that includes it and overwrite its judgement.
        self._polling = {spec.name: asyncio.Lock() for spec, _, _ in models}
        for spec, pool, _ in models:
            for worker in pool.workers:
                self.watch(spec.name, worker)

    def watch(self, model: str, worker: Worker) -> None:
        """Read `worker` again whenever it drops out pending re-verification."""
        wake = self._wake[model]
        worker.on_needs_verification(lambda _: wake.set())

    async def verify_startup(self, timeout_s: float) -> list[ModelJudgement]:
        """Read every worker, retrying unreachable ones with backoff until `timeout_s`, then judge each model."""
        deadline = time.monotonic() + timeout_s
        readings: dict[Worker, Reading] = {}
        backoff_s = 0.1
        while True:
            pending = [(w, health) for _, pool, health in self._models for w in pool.workers
                       if w not in readings or readings[w].info is None]
            results = await asyncio.gather(*(self._read(w, health, with_metrics=True) for w, health in pending))
            pending_workers = [w for w, _ in pending]
            readings.update(zip(pending_workers, results))
            unreachable = [w for w in pending_workers if readings[w].info is None]
            remaining_s = deadline - time.monotonic()
            if not unreachable or remaining_s <= 0:
                break
            log.info("waiting for %d unreachable worker(s): %s", len(unreachable),
                     ", ".join(w.url for w in unreachable))
            await asyncio.sleep(min(backoff_s, remaining_s))
            backoff_s = min(backoff_s * 2, 2.0)
        return [self._judge(spec, {w: readings[w] for w in pool.workers}, startup=True)
                for spec, pool, _ in self._models]

    def update(self, spec: ModelSpec, health: HealthSpec) -> None:
        """A reloaded configuration: the model's gate settings and health checks from the next read on."""
        self._models = [(spec, pool, health) if old.name == spec.name else (old, pool, old_health)
                        for old, pool, old_health in self._models]
        self._wake[spec.name].set()

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run(spec.name), name=f"kvgate-monitor-{spec.name}")
                       for spec, _, _ in self._models]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def verify_now(self, model: str) -> ModelJudgement:
        """Read and judge every worker of `model` now (a worker was just added), applying the verdicts."""
        return await self._poll(self._watched(model))

    def _watched(self, model: str) -> Watched:
        return next(w for w in self._models if w[0].name == model)

    async def poll_once(self) -> None:
        for watched in self._models:
            await self._poll(watched)

    async def _poll(self, watched: Watched) -> ModelJudgement:
        async with self._polling[watched[0].name]:
            return await self._poll_now(self._watched(watched[0].name))

    async def _poll_now(self, watched: Watched) -> ModelJudgement:
        spec, pool, health = watched
        workers = list(pool.workers)
        results = await asyncio.gather(*(self._read(w, health, with_metrics=False) for w in workers))
        readings = dict(zip(workers, results))
        for worker, reading in readings.items():
            worker.record_health(reading.info is not None and reading.healthy,
                                 failure_threshold=health.failure_threshold, success_threshold=health.success_threshold)
        return self._judge(spec, readings, startup=False)

    def _judge(self, spec: ModelSpec, readings: dict[Worker, Reading], *, startup: bool) -> ModelJudgement:
        """Judge a model, apply each verdict to its worker, then let the gateway follow (limits, metrics)."""
        judgement = judge_model(spec, readings, startup=startup)
        for verdict in judgement.workers:
            info = verdict.reading.info
            verdict.worker.note_checks(verdict.checks)  # none when it could not be read: nothing stale stays
            if verdict.problems:
                verdict.worker.refuse("; ".join(verdict.problems))
            elif info is not None:
                verdict.worker.accept(info.identity)
            # else: a verified worker missed one read; its health (with thresholds) decides
        self._on_judgement(judgement, startup)
        return judgement

    async def _run(self, model: str) -> None:
        wake = self._wake[model]
        while True:
            watched = self._watched(model)
            try:
                async with asyncio.timeout(watched[2].interval_s):
                    await wake.wait()
                await asyncio.sleep(_MIN_REREAD_S)
            except TimeoutError:
                pass
            wake.clear()
            try:
                await self._poll(self._watched(model))
            except Exception:  # the monitor must outlive any one bad reading
                log.exception("worker monitor poll failed")

    async def _read(self, worker: Worker, health: HealthSpec, *, with_metrics: bool) -> Reading:
        return await read_worker(self._engines, worker.url, timeout_s=health.timeout_s, with_metrics=with_metrics,
                                 health_path=health.path)
