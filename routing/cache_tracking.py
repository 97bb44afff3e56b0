"""Keeps every prefill worker of a pool with a cache index and, where its engine publishes KV events, a subscriber:
made when the worker joins rotation (with its engine's page size and pool), made anew whenever it rejoins, since a
rejoining worker may be another engine process with an empty cache."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from functools import partial
from urllib.parse import urlsplit

from routing.prefix_index.index import DEFAULT_INDEX_BYTES, CacheIndex, CacheMode
from routing.prefix_index.subscriber import MAX_EVENT_RANKS, EventsEndpoint, KvEventSubscriber, connectable
from routing.workers import Worker

log = logging.getLogger("kvgate.kv_events")

OnMode = Callable[[Worker, CacheMode], None]


class CacheTracking:
    def __init__(self, *, configured: Mapping[str, EventsEndpoint], liveness_s: float, follow_events: bool = True,
                 index_bytes: int = DEFAULT_INDEX_BYTES, on_mode: OnMode | None = None,
                 per_block_evictions: bool = False) -> None:
        """`configured`: KV-event endpoints by worker URL, from YAML (others are read from the engine's
        /server_info); `liveness_s`: how soon a silent publisher puts its worker back to approximate mode;
        `follow_events=False`: no subscriber at all (every index routes by what kvgate sent); `index_bytes`: the most
        one worker's index may take, whatever pool its engine claims (divided among its ranks' views)."""
        self._index_bytes = index_bytes
        self._per_block_evictions = per_block_evictions  # routing.kv_events: per_block (see CacheIndex)
        self._follow_events = follow_events
        self._configured = dict(configured)
        self._liveness_s = liveness_s
        self._on_mode = on_mode
        self.subscribers: dict[Worker, KvEventSubscriber] = {}
        self._attached: set[Worker] = set()  # in the pool: a verdict that lands after a removal subscribes nothing
        self._stopping: set[asyncio.Task[None]] = set()
        self._closed = False

    def attach(self, worker: Worker) -> None:
        """Track `worker` (a prefill) from now on."""
        if worker.role != "prefill":
            return
        self._attached.add(worker)
        worker.on_join(self._joined)
        if worker.verified is not None:
            self._joined(worker)

    def detach(self, worker: Worker) -> None:
        self._attached.discard(worker)
        self._drop(worker)

    def _drop(self, worker: Worker) -> None:
        subscriber = self.subscribers.pop(worker, None)
        if subscriber is not None:
            self._stop_later(subscriber)

    async def stop(self) -> None:
        self._closed = True
        for worker in list(self.subscribers):
            self.detach(worker)
        await asyncio.gather(*self._stopping, return_exceptions=True)

    def _joined(self, worker: Worker) -> None:
        identity = worker.verified
        if identity is None or self._closed or worker not in self._attached:
            return
        index = worker.cache_index = CacheIndex(page_size=identity.page_size, capacity_tokens=identity.pool_tokens,
                                                max_bytes=self._index_bytes,
                                                per_block_evictions=self._per_block_evictions)
        self._drop(worker)
        endpoints = self._endpoints(worker)
        if not endpoints:
            return
        try:
            subscriber = KvEventSubscriber(worker.url, index, endpoints, liveness_s=self._liveness_s,
                                           on_mode=partial(self._mode_changed, worker))
            subscriber.start()  # closes whatever it opened when it fails
        except Exception as exc:  # a bad endpoint must not keep the worker out of rotation: it routes approximately
            index.events_refused = f"cannot subscribe: {exc}"
            log.warning("KV events of %s: cannot subscribe (%s); routing by what kvgate sent", worker.url, exc)
            return
        self.subscribers[worker] = subscriber

    def _endpoints(self, worker: Worker) -> list[EventsEndpoint]:
        if not self._follow_events:
            return []
        host = urlsplit(worker.url).hostname or "127.0.0.1"
        configured = self._configured.get(worker.url)
        if configured is not None:
            return [configured]
        identity = worker.verified
        if identity is None or identity.kv_events_config is None:
            return []
        if identity.event_ranks > MAX_EVENT_RANKS:  # an engine's claim: never followed past what one worker may cost
            reason = (f"dp_size {identity.event_ranks} is over the {MAX_EVENT_RANKS} KV event publishers kvgate "
                      "follows per worker")
            if worker.cache_index is not None:
                worker.cache_index.events_refused = reason
            log.warning("KV events of %s: %s; routing by what kvgate sent", worker.url, reason)
            return []
        settings = json.loads(identity.kv_events_config)
        endpoint, replay = settings.get("endpoint", "tcp://*:5557"), settings.get("replay_endpoint")
        topic = settings.get("topic") or ""
        try:
            return [EventsEndpoint(connectable(endpoint, host, rank),
                                   connectable(replay, host, rank) if replay else None, topic)
                    for rank in range(identity.event_ranks)]
        except ValueError as exc:
            log.warning("KV events of %s: %s", worker.url, exc)
            return []

    def _mode_changed(self, worker: Worker, mode: CacheMode) -> None:
        if self._on_mode is not None:
            self._on_mode(worker, mode)

    def _stop_later(self, subscriber: KvEventSubscriber) -> None:
        try:
            task = asyncio.get_running_loop().create_task(subscriber.stop())
        except RuntimeError:  # no loop: nothing was started either
            return
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)
