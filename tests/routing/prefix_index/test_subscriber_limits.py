"""What one engine's claims can cost the gateway's KV-event subscribers: a `dp_size` far beyond any real deployment
is refused (it would take every socket pyzmq's shared context has, and other workers would get no subscriber), and
a subscription that fails part-way leaves nothing open."""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import replace

from loadtests.engine.harness import free_port
from routing.cache_tracking import CacheTracking
from routing.engines.identity import EngineIdentity
from routing.prefix_index import CacheIndex, CacheMode
from routing.prefix_index.subscriber import MAX_EVENT_RANKS, EventsEndpoint, KvEventSubscriber
from routing.workers import Worker, WorkerSpec
from tests.routing.prefix_index.test_kv_events import A, Publisher, prompt, stored, until

PREFILL = EngineIdentity(100_000, 99_000, 16, "0.5.23", "prefill", "glm-5", "/t", 131072)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def prefill(port: int, replay: int, ranks: int) -> Worker:
    worker = Worker(WorkerSpec(f"http://127.0.0.1:{30000 + ranks}", "prefill"))
    config = {"publisher": "zmq", "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay}"}
    worker.accept(replace(PREFILL, kv_events_config=json.dumps(config), event_ranks=ranks))
    return worker


def test_an_engine_claiming_600_ranks_is_refused_and_the_next_worker_still_subscribes() -> None:
    async def scenario() -> None:
        ports = free_port(), free_port()
        publisher = Publisher(*ports)
        tracking = CacheTracking(configured={}, liveness_s=0.3)
        greedy, honest = prefill(free_port(), free_port(), 600), prefill(*ports, 1)
        before = open_fds()
        try:
            tracking.attach(greedy)
            assert greedy not in tracking.subscribers and open_fds() <= before + 2
            assert greedy.cache_index is not None and "dp_size 600" in (greedy.cache_index.events_refused or "")
            tracking.attach(honest)
            assert honest in tracking.subscribers
            await asyncio.sleep(0.3)  # the slow joiner
            assert honest.cache_index is not None
            honest.cache_index.record(prompt(A))
            await publisher.publish(stored(A, 100))
            await until(lambda: honest.cache_index is not None and honest.cache_index.held_blocks == 10)
            assert honest.cache_index.mode is CacheMode.EXACT
        finally:
            await tracking.stop()
            await publisher.close()

    asyncio.run(scenario())


def test_a_subscription_that_fails_part_way_closes_every_socket_it_opened() -> None:
    async def scenario() -> None:
        before = open_fds()
        endpoints = [EventsEndpoint(f"tcp://127.0.0.1:{free_port()}") for _ in range(MAX_EVENT_RANKS - 1)]
        index = CacheIndex(per_block_evictions=True, page_size=16, capacity_tokens=100_000)
        subscriber = KvEventSubscriber("broken", index, [*endpoints, EventsEndpoint("tcp://no-port")],
                                       liveness_s=0.3)
        try:
            subscriber.start()
        except Exception as exc:  # the last rank's endpoint cannot be connected to
            assert "argument" in str(exc).lower(), exc
        else:
            raise AssertionError("start() should have failed")
        await asyncio.sleep(0.1)
        assert open_fds() <= before + 2, (before, open_fds())
        assert index.ranks == [] and index.mode is CacheMode.APPROXIMATE

    asyncio.run(scenario())


def test_more_ranks_than_the_cap_are_refused_before_anything_opens() -> None:
    index = CacheIndex(per_block_evictions=True, page_size=16, capacity_tokens=100_000)
    endpoints = [EventsEndpoint(f"tcp://127.0.0.1:{6000 + i}") for i in range(MAX_EVENT_RANKS + 1)]
    try:
        KvEventSubscriber("greedy", index, endpoints, liveness_s=0.3)
    except ValueError as exc:
        assert str(MAX_EVENT_RANKS) in str(exc)
    else:
        raise AssertionError("more than MAX_EVENT_RANKS publishers should be refused")
    assert index.ranks == []
