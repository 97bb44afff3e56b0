"""A hostile review of the KV-event fixes (attack21): what a lying engine's publisher can still make the gateway's
subscriber do. The publisher here runs in a thread of its own (a real engine is another process), so it can send as
fast as ZMQ allows while the gateway's loop is measured."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import msgspec
import pytest

from loadtests.engine.harness import free_port
from routing.cache_tracking import CacheTracking
from routing.prefix_index import CacheIndex, CacheMode
from routing.prefix_index.events import MAX_BATCH_TOKENS, EventDecoder, MalformedBatch, decode_batch, split_batch
from routing.prefix_index.subscriber import EventsEndpoint, KvEventSubscriber
from tests.routing.prefix_index.test_cache_aware import prompt, sglang_page_hashes
from tests.routing.prefix_index.test_kv_events import LoopLag, until, wired
from tests.routing.prefix_index.test_subscriber_limits import prefill

_FLOOD = """
import sys, time, zmq
port, count, payload = int(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(sys.argv[3])
ctx = zmq.Context()
pub = ctx.socket(zmq.PUB)
pub.setsockopt(zmq.LINGER, 0)
pub.setsockopt(zmq.SNDHWM, 0)
pub.bind(f"tcp://127.0.0.1:{port}")
print("ready", flush=True)
sys.stdin.readline()
for seq in range(count):
    pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
time.sleep(0.5)
"""


class FloodingPublisher:
    """An engine's PUB socket in a process of its own, sending `count` well-formed batches of `payload`, in sequence,
    as fast as it can once told to."""

    def __init__(self, port: int, payload: bytes, count: int) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", _FLOOD, str(port), str(count), payload.hex()],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.process.stdout is not None and self.process.stdout.readline() == b"ready\n"

    def flood(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(b"go\n")
        self.process.stdin.flush()

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.mark.long_running(seconds=15)
def test_a_flood_of_tiny_well_formed_batches_never_stalls_the_event_loop() -> None:
    """Each message already queued is received without a hand-over (pyzmq completes the future at once), and a tiny
    batch never reaches the 2,048 pages after which _apply yields: a publisher that keeps the queue non-empty holds
    the loop for as long as it likes."""

    async def scenario() -> None:
        port = free_port()
        flood = FloodingPublisher(port, msgspec.msgpack.encode([0.0, []]), 1_000_000)
        index = CacheIndex(per_block_evictions=True, page_size=16, capacity_tokens=1_000_000)
        subscriber = KvEventSubscriber("hostile", index, [EventsEndpoint(f"tcp://127.0.0.1:{port}")], liveness_s=5)
        subscriber.start()
        try:
            await until(lambda: all(rank.connected for rank in subscriber._ranks))
            await asyncio.sleep(0.3)  # the slow joiner
            lag = LoopLag()
            flood.flood()
            await until(lambda: subscriber.stats.batches >= 1, timeout_s=10)
            await until(lambda: flood.process.poll() is not None, timeout_s=60)
            worst = await lag.stop()
        finally:
            await subscriber.stop()
            flood.close()
        assert worst < 0.25, f"the loop was held {worst:.2f} s by {subscriber.stats.batches} tiny batches"

    asyncio.run(scenario())


def _tails(index: CacheIndex) -> tuple[int, int]:
    """(pages the views hold, bytes of token ids those pages keep as their block's unfinished tail)."""
    pages = [entry for view in index.ranks for entry in view._pages.values()]
    return len(pages), sum(len(tail) for _, tail, _ in pages)


def test_a_page_larger_than_the_engines_page_size_cannot_make_one_page_hold_megabytes() -> None:
    """An event's block_size is the engine's claim, never checked against the page size /server_info gave: one page
    of 4M tokens ends one block of 32 and keeps the other 3,999,968 tokens (16 MB) as its tail; the view's page cap
    counts pages, not bytes, so a few thousand such batches take the host's memory."""

    async def scenario() -> None:
        async with wired(page_size=16) as (publisher, subscriber, index, _):
            huge = 4_000_000
            for page_hash in (11, 12, 13):
                await publisher.publish([["BlockStored", [page_hash], None, [1] * huge, huge, None]])
            await until(lambda: subscriber.stats.batches + subscriber.stats.malformed >= 3, timeout_s=30)
            pages, tail_bytes = _tails(index)
            # An honest page of 16 tokens leaves at most a block's worth (32 tokens, 128 bytes) as a tail.
            assert tail_bytes <= pages * index.block_tokens * 4, f"{pages} pages keep {tail_bytes:,} bytes"

    asyncio.run(scenario())


def test_one_event_at_the_byte_cap_never_stalls_the_event_loop() -> None:
    """The slices bound pages, not tokens: one BlockStored of one page carrying 16M one-byte token ids (a legal
    16 MiB batch) is decoded in one msgspec call and stored in one `store` call (array of 16M ids, tail copies)."""

    async def scenario() -> None:
        async with wired(page_size=16) as (publisher, subscriber, index, _):
            huge = 16 * 2**20 - 64
            payload = msgspec.msgpack.encode([0.0, [["BlockStored", [21], None, [1] * huge, huge, None]]])
            lag = LoopLag()
            await publisher.publish([], payload=payload)
            await until(lambda: subscriber.stats.batches >= 1, timeout_s=30)
            await asyncio.sleep(0.05)
            worst = await lag.stop()
            assert worst < 0.25, f"the loop was held {worst:.2f} s by one event"

    asyncio.run(scenario())


def test_token_ids_and_page_lengths_are_capped_per_batch() -> None:
    too_many = [["BlockStored", [i], None, [1] * 16, 16, None] for i in range(MAX_BATCH_TOKENS // 16 + 1)]
    with pytest.raises(MalformedBatch):
        decode_batch(msgspec.msgpack.encode([0.0, too_many]))
    longer_page = msgspec.msgpack.encode([0.0, [["BlockStored", [1], None, [1] * 64, 64, None]]])
    assert len(decode_batch(longer_page)) == 1  # the page size is the subscriber's to know
    decoder = EventDecoder(page_size=16)
    with pytest.raises(MalformedBatch):
        decoder.decode(split_batch(longer_page)[0])
    assert decoder.decode(split_batch(msgspec.msgpack.encode([0.0, [["BlockStored", [1], None, [1] * 5, 5, None]]]))[0])


def test_a_worker_removed_while_a_poll_is_in_flight_is_never_subscribed_again() -> None:
    """The monitor judges the workers it read before a removal landed (`_poll_now` awaits every read, which a slow
    engine stretches to its timeout): a worker removed while out of rotation and then accepted by that verdict
    joins again, and `_joined` made a subscriber for it that nothing ever stops (2 ZMQ threads, ~5 fds a rank, a
    liveness probe forever)."""

    async def scenario() -> None:
        tracking = CacheTracking(configured={}, liveness_s=0.3)
        worker = prefill(free_port(), free_port(), 8)
        identity = worker.verified
        assert identity is not None
        try:
            tracking.attach(worker)
            assert worker in tracking.subscribers
            worker.refuse("a bad read")  # out of rotation, its subscriber kept
            tracking.detach(worker)  # the pool's on_remove: an admin DELETE, a reload, DNS dropping it
            worker.accept(identity)  # the verdict of the poll that read it before the removal
            assert worker not in tracking.subscribers, "a removed worker got a subscriber"
        finally:
            await tracking.stop()

    asyncio.run(scenario())


def test_a_publisher_falling_silent_never_raises_a_prediction_its_evictions_lowered() -> None:
    """A block the engine reported evicted stops counting; when the publisher then goes silent (or its replay
    socket stops answering a probe: a lying engine can toggle that), the index falls back to approximate mode,
    whose match read only the sent view: every reported eviction counted for nothing again."""
    ids = list(range(200, 520))
    index = CacheIndex(per_block_evictions=True, page_size=16, capacity_tokens=100_000)
    rank = index.engine_view()
    index.mode = CacheMode.EXACT
    index.record(prompt(ids, "a"))
    hashes = sglang_page_hashes(ids, 16)
    rank.store(hashes, None, ids, 16)
    rank.remove(hashes)
    assert index.match(prompt(ids, "a")) == 0
    index.mode = CacheMode.APPROXIMATE  # the publisher went silent
    assert index.match(prompt(ids, "a")) == 0, "a silent publisher brought back what it had reported evicted"
