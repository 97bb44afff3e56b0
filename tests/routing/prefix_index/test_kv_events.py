"""The KV-event subscriber against a real ZMQ publisher on loopback (PUB + ROUTER replay, framed as SGLang's
ZmqEventPublisher frames them): in-order application, gap replay, late subscription, malformed batches, a publisher
that restarts, and one that dies (approximate mode within one liveness interval)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from loadtests.engine.harness import free_port  # below the ephemeral range: no outgoing connection takes it meanwhile
from routing.prefix_index import CacheIndex, CacheMode, PromptTokens
from routing.prefix_index.blocks import ids_to_bytes
from routing.prefix_index.subscriber import EventsEndpoint, KvEventSubscriber

LIVENESS_S = 0.3




class Publisher:
    """SGLang's publisher, as a test double on real sockets: sequence from 0, a replay buffer, -1 at the end."""

    def __init__(self, pub_port: int, replay_port: int, topic: bytes = b"") -> None:
        self.topic = topic
        ctx = zmq.asyncio.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        for sock, port in ((self.pub, pub_port), (self.replay, replay_port)):
            for attempt in range(100):  # a port just given back by a closed publisher takes ZMQ's IO thread a moment
                try:
                    sock.bind(f"tcp://127.0.0.1:{port}")
                    break
                except zmq.ZMQError:
                    if attempt == 99:
                        raise
                    time.sleep(0.02)
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def publish(self, events: list[object], *, send: bool = True, payload: bytes | None = None) -> None:
        body = payload if payload is not None else msgspec.msgpack.encode([0.0, events])
        seq, self.seq = self.seq, self.seq + 1
        self.buffer.append((seq, body))
        if send:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), body])

    async def _serve_replay(self) -> None:
        while True:
            client, _, start = await self.replay.recv_multipart()
            first = int.from_bytes(start, "big", signed=True)
            for seq, body in self.buffer:
                if seq >= first:
                    await self.replay.send_multipart([client, b"", seq.to_bytes(8, "big"), body])
            await self.replay.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.pub.close(linger=0)
        self.replay.close(linger=0)


def stored(ids: list[int], first_hash: int, parent: int | None = None) -> list[object]:
    """0.5.8's shape: one BlockStored per page (page size 16)."""
    events: list[object] = []
    for i in range(0, len(ids), 16):
        page_hash = first_hash + i // 16
        events.append(["BlockStored", [page_hash], parent, ids[i:i + 16], 16, None])
        parent = page_hash
    return events


def prompt(ids: list[int]) -> PromptTokens:
    return PromptTokens(ids_to_bytes(ids), tokens=len(ids), namespace="t")


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


@asynccontextmanager
async def wired(page_size: int = 16) -> AsyncIterator[tuple[Publisher, KvEventSubscriber, CacheIndex, tuple[int, int]]]:
    ports = free_port(), free_port()
    publisher = Publisher(*ports)
    index = CacheIndex(per_block_evictions=True, page_size=page_size, capacity_tokens=1_000_000)
    subscriber = KvEventSubscriber("test", index, [EventsEndpoint(f"tcp://127.0.0.1:{ports[0]}",
                                                                  f"tcp://127.0.0.1:{ports[1]}")],
                                   liveness_s=LIVENESS_S)
    subscriber.start()
    await until(lambda: all(rank.connected for rank in subscriber._ranks))
    await asyncio.sleep(0.2)  # the slow-joiner: a SUB misses what is published before its subscription lands
    try:
        yield publisher, subscriber, index, ports
    finally:
        await subscriber.stop()
        await publisher.close()


Wired = tuple[Publisher, KvEventSubscriber, CacheIndex, tuple[int, int]]


async def _in_wired(scenario: Callable[[Wired], Coroutine[Any, Any, None]]) -> None:
    async with wired() as setup:
        await scenario(setup)


A = list(range(1000, 1320))  # 320 tokens: 20 pages of 16, 10 blocks of 32


def test_events_are_applied_in_order_and_an_eviction_shows_at_the_next_match() -> None:
    asyncio.run(_in_wired(_test_events_are_applied_in_order_and_an_eviction_shows_at_the_next_match))


async def _test_events_are_applied_in_order_and_an_eviction_shows_at_the_next_match(wired: Wired) -> None:
    publisher, subscriber, index, _ = wired
    index.record(prompt(A))
    await publisher.publish(stored(A, 100))
    await until(lambda: subscriber.mode is CacheMode.EXACT and index.held_blocks == 10)
    assert index.match(prompt(A)) == 288
    await publisher.publish([["BlockRemoved", [112, 113, 114, 115, 116, 117, 118, 119]]])
    await until(lambda: index.held_blocks == 6)
    assert index.match(prompt(A)) == 192


def test_a_gap_is_replayed_and_a_malformed_batch_is_counted_and_skipped() -> None:
    asyncio.run(_in_wired(_test_a_gap_is_replayed_and_a_malformed_batch_is_counted_and_skipped))


async def _test_a_gap_is_replayed_and_a_malformed_batch_is_counted_and_skipped(wired: Wired) -> None:
    publisher, subscriber, index, _ = wired
    index.record(prompt(A))
    await publisher.publish(stored(A[:160], 100))
    await publisher.publish(stored(A[160:], 110, parent=109), send=False)  # lost on the way
    await publisher.publish([], payload=b"\xc1 not msgpack")
    await until(lambda: subscriber.stats.malformed == 1)
    assert subscriber.stats.gaps_replayed == 1
    assert index.match(prompt(A)) == 288  # the replayed batch is in
    assert subscriber.mode is CacheMode.PARTIAL  # a batch skipped is a batch lost: whatever it held is not seen


class LoopLag:
    """The longest the event loop went without running a 1 ms ticker."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(0.001)
            self.worst = max(self.worst, loop.time() - before - 0.001)

    async def stop(self) -> float:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        return self.worst


@pytest.mark.long_running(seconds=8)
def test_huge_batches_never_stall_the_event_loop() -> None:
    async def scenario() -> None:
        async with wired(page_size=1) as setup:
            await _test_huge_batches_never_stall_the_event_loop(setup)

    asyncio.run(scenario())


async def _test_huge_batches_never_stall_the_event_loop(wired: Wired) -> None:
    publisher, subscriber, index, _ = wired
    # Encoded before the loop is measured: the publisher shares the loop with the subscriber here.
    pages = [["BlockStored", [1 << 40 | i], (1 << 40 | i - 1) if i else None, [i % 50_000], 1, None]
             for i in range(300_000)]  # a legal batch, under every cap: 300,000 pages, one event each, ~8 MiB
    legal = msgspec.msgpack.encode([0.0, pages])
    bad_last = msgspec.msgpack.encode([0.0, [["BlockRemoved", [7]]] * 1_000_000 + [["Evicted"]]])  # ~15 MiB
    removed = msgspec.msgpack.encode([0.0, [["BlockRemoved", [i % 100 for i in range(10_000_000)]]]])  # 10 MiB
    del pages
    lag = LoopLag()
    await publisher.publish([], payload=legal)
    await until(lambda: index.held_blocks == 300_000 // 32, timeout_s=60)
    await publisher.publish([], payload=bad_last)
    await publisher.publish([], payload=removed)
    await until(lambda: subscriber.stats.malformed == 2, timeout_s=30)
    worst = await lag.stop()
    assert index.held_blocks == 300_000 // 32  # neither refused batch removed a thing
    assert subscriber.mode is CacheMode.PARTIAL
    # Without the slices: seconds. A shared 2-core machine accounts for the margin.
    assert worst < 0.25, worst


def test_a_tail_lost_without_a_later_batch_is_fetched_by_the_liveness_probe() -> None:
    asyncio.run(_in_wired(_test_a_tail_lost_without_a_later_batch_is_fetched_by_the_liveness_probe))


async def _test_a_tail_lost_without_a_later_batch_is_fetched_by_the_liveness_probe(wired: Wired) -> None:
    publisher, subscriber, index, _ = wired
    index.record(prompt(A))
    await publisher.publish(stored(A[:160], 100))
    await publisher.publish(stored(A[160:], 110, parent=109), send=False)
    await until(lambda: index.held_blocks == 10, timeout_s=3 * LIVENESS_S + 2)


def test_a_deeply_nested_replayed_batch_is_malformed_and_the_probe_lives_on() -> None:
    asyncio.run(_in_wired(_test_a_deeply_nested_replayed_batch_is_malformed_and_the_probe_lives_on))


async def _test_a_deeply_nested_replayed_batch_is_malformed_and_the_probe_lives_on(wired: Wired) -> None:
    publisher, subscriber, index, _ = wired
    # 100,000 nested arrays: msgpack's decoder raises RecursionError. Only the replay (the liveness probe) sees it.
    await publisher.publish([], send=False, payload=b"\x91" * 100_000 + b"\x01")
    await until(lambda: subscriber.stats.malformed == 1, timeout_s=3 * LIVENESS_S + 2)
    await publisher.publish(stored(A, 100), send=False)  # a tail only the next probe can fetch
    await until(lambda: index.held_blocks == 10, timeout_s=3 * LIVENESS_S + 2)
    assert all(not task.done() for rank in subscriber._ranks for task in rank.tasks)


def test_a_late_subscriber_replays_history_and_a_publisher_restart_empties_the_view() -> None:
    asyncio.run(_in_wired(_test_a_late_subscriber_replays_history_and_a_publisher_restart_empties_the_view))


async def _test_a_late_subscriber_replays_history_and_a_publisher_restart_empties_the_view(wired: Wired) -> None:
    publisher, subscriber, index, ports = wired
    index.record(prompt(A))
    await publisher.publish(stored(A, 100), send=False)  # before kvgate was listening
    await publisher.publish([["BlockRemoved", [119]]])
    await until(lambda: subscriber.mode is CacheMode.EXACT)
    assert index.match(prompt(A)) == 288  # page 119 ends the last block, not a cacheable one (the 320th token)
    await publisher.close()  # the engine restarts: a new process, its sequence from 0
    restarted = Publisher(*ports)
    try:
        await until(lambda: all(rank.connected for rank in subscriber._ranks))
        await asyncio.sleep(0.2)
        await restarted.publish(stored(A[:64], 500))
        await until(lambda: subscriber.stats.restarts == 1)
        assert index.match(prompt(A)) == 0  # nothing kvgate sent before is held by the new process
    finally:
        await restarted.close()


def test_a_cache_cleared_in_replayed_history_keeps_what_kvgate_sent_since_subscribing() -> None:
    asyncio.run(_in_wired(_test_a_cache_cleared_in_replayed_history_keeps_what_kvgate_sent_since_subscribing))


async def _test_a_cache_cleared_in_replayed_history_keeps_what_kvgate_sent_since_subscribing(wired: Wired) -> None:
    publisher, subscriber, index, _ = wired
    await publisher.publish([["AllBlocksCleared"]], send=False)  # the engine's start, before kvgate listened
    index.record(prompt(A))  # sent while the history is not yet replayed (a slow catch-up under load)
    await publisher.publish([])  # the first live batch: history [0, 1) is replayed before it
    await until(lambda: subscriber.stats.batches == 2 and subscriber.mode is CacheMode.EXACT)
    assert index.match(prompt(A)) == 288  # the old clear did not wipe a prompt sent after it
    await publisher.publish([["AllBlocksCleared"]])  # a live clear (a flush now) does
    await until(lambda: index.match(prompt(A)) == 0)


def test_a_killed_publisher_falls_back_to_approximate_within_one_interval() -> None:
    asyncio.run(_in_wired(_test_a_killed_publisher_falls_back_to_approximate_within_one_interval))


async def _test_a_killed_publisher_falls_back_to_approximate_within_one_interval(wired: Wired) -> None:
    publisher, subscriber, index, _ = wired
    index.record(prompt(A))
    await publisher.publish(stored(A, 100))
    await until(lambda: subscriber.mode is CacheMode.EXACT)
    await publisher.close()
    started = asyncio.get_running_loop().time()
    await until(lambda: subscriber.mode is CacheMode.APPROXIMATE, timeout_s=2 * LIVENESS_S + 1)
    assert asyncio.get_running_loop().time() - started <= 2 * LIVENESS_S + 0.5
    assert index.mode is CacheMode.APPROXIMATE and index.match(prompt(A)) == 288  # routes by what kvgate sent


def test_only_the_configured_topic_is_followed() -> None:
    async def scenario() -> None:
        ports = free_port(), free_port()
        publisher = Publisher(*ports, topic=b"kv-prefill-0")
        indexes = {}
        subscribers = []
        for topic in ("kv-prefill-0", "kv-other"):
            index = indexes[topic] = CacheIndex(per_block_evictions=True, page_size=16, capacity_tokens=1_000_000)
            subscriber = KvEventSubscriber(topic, index, [EventsEndpoint(f"tcp://127.0.0.1:{ports[0]}", None, topic)],
                                           liveness_s=LIVENESS_S)
            subscriber.start()
            subscribers.append(subscriber)
        try:
            await until(lambda: all(rank.connected for sub in subscribers for rank in sub._ranks))
            await asyncio.sleep(0.2)
            await publisher.publish(stored(A, 100))
            await until(lambda: indexes["kv-prefill-0"].held_blocks == 10)
            await asyncio.sleep(0.2)
            assert indexes["kv-other"].held_blocks == 0 and subscribers[1].stats.batches == 0
        finally:
            for subscriber in subscribers:
                await subscriber.stop()
            await publisher.close()

    asyncio.run(scenario())


def test_a_publisher_that_keeps_reporting_its_cache_cleared_is_refused_and_the_sent_view_kept() -> None:
    asyncio.run(_in_wired(_test_a_publisher_that_keeps_reporting_its_cache_cleared_is_refused_and_the_sent_view_kept))


async def _test_a_publisher_that_keeps_reporting_its_cache_cleared_is_refused_and_the_sent_view_kept(
        wired: Wired) -> None:
    """Each live AllBlocksCleared wipes what kvgate sent there, so a publisher that kept sending them would keep its
    prefill the emptiest index (and draw the traffic): past MAX_EMPTIED a minute its events are refused."""
    from routing.prefix_index.subscriber import MAX_EMPTIED
    publisher, subscriber, index, _ = wired
    for _ in range(MAX_EMPTIED):  # a few flushes: an operator's, honoured
        index.record(prompt(A))
        await publisher.publish([["AllBlocksCleared"]])
        await until(lambda: index.match(prompt(A)) == 0)
    assert subscriber.refused is None and index.events_refused is None
    index.record(prompt(A))
    await publisher.publish([["AllBlocksCleared"]])  # one more within the minute: a faulty publisher
    await until(lambda: subscriber.refused is not None)
    assert "AllBlocksCleared" in (index.events_refused or "")
    assert subscriber.mode is CacheMode.APPROXIMATE
    assert index.match(prompt(A)) == 288  # the sent view is kept
    await publisher.publish([["AllBlocksCleared"]])
    await publisher.publish(stored(A, 100))
    await asyncio.sleep(0.3)
    assert index.match(prompt(A)) == 288 and index.held_blocks == 0  # nothing more it sends is applied
