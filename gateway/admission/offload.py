"""Admission of large bodies in a worker process, so no request can stall the event loop.

Threads are not enough: parsing JSON (orjson), rendering a template and joining large strings are C calls that hold
the GIL throughout — a 64 MiB body of tiny objects takes seconds to parse — and the event loop waits for every one
of them. A large body (`gateway.http.body`) is therefore admitted whole (parse, reduce, render, count, build the
engine body) in a separate process, which reads it from the file it was spooled to; only the engine body of an
admitted request comes back. Small bodies, whose every step is bounded to a few milliseconds, stay on the loop, where
they are cheapest.

Each worker process builds every model's tokenizer, template and token-count cache once (lazily, on the first large
body); a tenant's bodies go to the same worker when it is free, so its count cache stays warm. The worker only
counts and checks: the gateway process still owns model availability, limits (sent with each call) and dispatch.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import BrokenExecutor, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from gateway.admission.admit import Admission, AdmittedRequest, PromptLimits
from gateway.admission.chat import ChatSettings, with_engine_defaults
from gateway.admission.dialects import Dialect
from gateway.admission.fair_share import FairShare
from gateway.admission.pipeline import admit_body, build_admission, resolve_model
from gateway.admission.requests import Route
from gateway.admission.tokenize import Kind, answer
from gateway.config import ModelConfig
from gateway.errors import GatewayError
from gateway.parent_death import die_with_parent

T = TypeVar("T")
log = logging.getLogger("kvgate.admission")

@dataclass(frozen=True, slots=True)
class ModelState:
    """What the worker must know of a model's current state (the gateway process owns it)."""

    limits: PromptLimits
    dialects: frozenset[Dialect]
    unavailable: str | None
    engine_template_defaults: str | None = None  # the engines' --default-chat-template-kwargs, JSON


class AdmissionWorkers:
    """`workers` processes, each admitting one large body at a time, shared fairly between tenants
    (`gateway.admission.fair_share`): a tenant flooding them with large bodies waits, and is refused, by itself."""

    def __init__(self, models: list[ModelConfig], *, workers: int, cache_bytes: int) -> None:
        self._models = models
        self._cache_bytes = cache_bytes
        self._executors: list[ProcessPoolExecutor | None] = [None] * workers
        self._share = FairShare(workers)

    async def admit(self, route: Route, body_path: str, *, tenant: str, line: str,
                    state: dict[str, ModelState]) -> AdmittedRequest:
        """`tenant` keys the worker's per-tenant caches (and its home worker); `line` is whose fair share the body
        waits in."""
        return await self._run(tenant, line, _admit, route, body_path, tenant, state)

    async def tokenize(self, kind: Kind, body_path: str, *, tenant: str, line: str,
                       limits: dict[str, PromptLimits]) -> bytes:
        """The JSON answer of `/v1/tokenize` or `/v1/detokenize` to a large body (see gateway.http.tokenize)."""
        return await self._run(tenant, line, _tokenize, kind, body_path, limits)

    async def _run(self, tenant: str, line: str, function: Callable[..., T], *args: Any) -> T:
        home = int.from_bytes(hashlib.blake2b(tenant.encode(), digest_size=4).digest(), "big") % len(self._executors)
        async with self._share.slot(line, home) as slot:
            executor = self._executor(slot)
            try:
                return await asyncio.get_running_loop().run_in_executor(executor, function, *args)
            except BrokenExecutor as exc:
                # The worker died (killed, out of memory): a fresh one serves the next large body.
                log.error("admission worker %d died (%s); restarting it", slot, exc)
                self._executors[slot] = None
                executor.shutdown(wait=False, cancel_futures=True)
                raise GatewayError(503, "the admission worker for large requests failed; retry",
                                   code="admission_unavailable") from exc

    def close(self) -> None:
        for executor in self._executors:
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)

    def _executor(self, slot: int) -> ProcessPoolExecutor:
        executor = self._executors[slot]
        if executor is None:
            # spawn: the gateway process runs threads (event loop, counting pools) that a fork would copy mid-state.
            executor = self._executors[slot] = ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker,
                initargs=(self._models, self._cache_bytes, os.getpid()))
        return executor


# ── in the worker process ───────────────────────────────────────────────────────────────────────────────────
_admissions: dict[str, Admission] = {}
_loop: asyncio.AbstractEventLoop | None = None


@dataclass(slots=True)
class _WorkerModel:
    admission: Admission
    state: ModelState

    @property
    def chat_settings(self) -> ChatSettings:
        return with_engine_defaults(self.admission.chat, self.state.engine_template_defaults)

    def dialects(self) -> frozenset[Dialect]:
        return self.state.dialects


def _start_worker(models: list[ModelConfig], cache_bytes: int, parent_pid: int) -> None:
    global _loop
    die_with_parent(parent_pid)
    _loop = asyncio.new_event_loop()
    for config in models:
        _admissions[config.name] = build_admission(config, cache_bytes=cache_bytes)


def _tokenize(kind: Kind, body_path: str, limits: dict[str, PromptLimits]) -> bytes:
    with open(body_path, "rb") as body:
        raw = body.read()

    def find(name: str | None) -> Admission:
        admission = resolve_model(name, _admissions, lambda _: None)
        admission.limits = limits[admission.model]
        return admission

    return answer(kind, raw, find)


def _admit(route: Route, body_path: str, tenant: str, state: dict[str, ModelState]) -> AdmittedRequest:
    assert _loop is not None
    with open(body_path, "rb") as body:
        raw = body.read()

    def find_model(name: str | None) -> _WorkerModel:
        admission = resolve_model(name, _admissions, lambda a: state[a.model].unavailable)
        admission.limits = state[admission.model].limits
        return _WorkerModel(admission, state[admission.model])

    return _loop.run_until_complete(admit_body(route, raw, tenant=tenant, find_model=find_model))
