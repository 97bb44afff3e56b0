"""Subscribing to one prefill engine's KV events (SGLang `ZmqEventPublisher`, one publisher per data-parallel rank
at the configured port + rank) and applying them, in order, to the worker's cache index.

Each gateway replica subscribes itself: the engine's report needs no shared state. Per rank:
- a SUB socket on the publisher; batches carry a sequence number that counts from 0 per engine process;
- a gap (a sequence ahead of the next expected) is filled from the publisher's replay socket (a ROUTER: send the
  first sequence wanted, get every buffered batch from it, then sequence -1); batches it no longer holds leave the
  view *partial*;
- a sequence behind the expected one is a restarted engine: its cache is empty;
- liveness: the SUB connection (ZMQ's socket monitor) and, with a replay socket, a replay request every
  `liveness_s` for the batches after the last one seen (which also fetches any tail a dropped message hid). A
  publisher that is down or does not answer puts the worker's index back to approximate mode until it does.
Malformed batches (or batches over the caps in events.py) are counted and skipped as a batch lost; nothing an
engine sends can stop the subscriber or hold the event loop (a batch is applied in slices).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from routing.prefix_index.events import (
    MAX_BATCH_BYTES,
    Cleared,
    EventDecoder,
    MalformedBatch,
    Removed,
    Stored,
    decode_sequence,
    split_batch,
)
from routing.prefix_index.index import CacheIndex, CacheMode, HeldBlocks

log = logging.getLogger("kvgate.kv_events")

_END = -1
# Work between two hand-overs to the event loop (a few ms at most): events decoded and pages applied.
_APPLY_YIELD_PAGES = 2048
# The most of one frame a socket takes (ZMQ_MAXMSGSIZE: a larger one disconnects the peer, so it is never read;
# the batch is a gap, replayed if it can be) and the batches it queues before dropping (ZMQ_RCVHWM: a drop is a
# gap too): at most 64 x 16 MiB queued per rank, where a real stream's batches are ~1.5 MiB at most.
_MAX_FRAME_BYTES = MAX_BATCH_BYTES + 4096
_RECEIVE_HWM = 64
# Publishers one subscriber follows (SGLang: one per attention data-parallel rank). Large expert-parallel prefills
# run dp-attention over up to a few nodes (8-32 ranks); each rank costs ~4 sockets and ~5 file descriptors here,
# so an engine claiming more (its /server_info's dp_size) is refused rather than followed.
MAX_EVENT_RANKS = 64
_SOCKETS_PER_RANK = 4  # the SUB, its monitor's two ends (one inside libzmq), a replay's DEALER
# An engine whose events report its cache emptied (a live AllBlocksCleared, a sequence that starts over) more than
# MAX_EMPTIED times in EMPTIED_WINDOW_S is faulty or lying: a real restart takes minutes and a flush is an operator's
# act. Each report would wipe what kvgate sent there and make that prefill the emptiest index again, so its events
# are refused from then on (the worker routes by what kvgate sent, as without events) until it rejoins rotation.
MAX_EMPTIED = 3
EMPTIED_WINDOW_S = 60.0


def _bounded(socket: zmq.asyncio.Socket) -> zmq.asyncio.Socket:
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, _MAX_FRAME_BYTES)
    socket.setsockopt(zmq.RCVHWM, _RECEIVE_HWM)
    return socket


@dataclass(frozen=True, slots=True)
class EventsEndpoint:
    """Where one rank publishes, as kvgate connects to it."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


def connectable(endpoint: str, host: str, rank: int = 0) -> str:
    """The engine's bind address as a connect address: a wildcard host becomes the worker's host, and the port is
    offset by the rank (`ZmqEventPublisher.offset_endpoint_port`)."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    parts = urlsplit(endpoint)
    bound = parts.hostname or "*"
    target = host if bound in ("*", "0.0.0.0", "::") else bound
    target = f"[{target}]" if ":" in target and not target.startswith("[") else target
    port = parts.port
    if port is None:
        raise ValueError(f"KV events endpoint {endpoint!r} has no port")
    return f"tcp://{target}:{port + rank}"


@dataclass
class SubscriberStats:
    batches: int = 0
    malformed: int = 0
    gaps_replayed: int = 0
    gaps_lost: int = 0
    restarts: int = 0


@dataclass
class _Rank:
    endpoint: EventsEndpoint
    view: HeldBlocks
    next_seq: int | None = None  # the next sequence expected; None until the first batch since (re)connecting
    complete: bool = False  # every batch since the engine's cache was last empty has been applied
    connected: bool = False
    answering: bool = True  # the replay socket answered its last liveness probe
    reconnected: bool = False  # the SUB connection dropped since the last batch (a sequence behind: a restart)
    last_streamed: int = -1  # the last sequence that came on the stream itself (not from a replay)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one batch applied at a time: stream, gaps, probes
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    sockets: list[zmq.asyncio.Socket] = field(default_factory=list)  # the SUB socket, then its monitor

    @property
    def live(self) -> bool:
        return self.connected and self.answering


_MONITOR_IDS = itertools.count()


class KvEventSubscriber:
    def __init__(self, name: str, index: CacheIndex, endpoints: list[EventsEndpoint], *, liveness_s: float,
                 on_mode: Callable[[CacheMode], None] | None = None) -> None:
        self.name = name  # the worker, for the log
        self.index = index
        self.stats = SubscriberStats()
        if len(endpoints) > MAX_EVENT_RANKS:
            raise ValueError(f"{len(endpoints)} KV event publishers (data-parallel ranks); at most {MAX_EVENT_RANKS}")
        self._liveness_s = liveness_s
        self._on_mode = on_mode
        # A context of its own, its socket count bounded to what its ranks need: one engine's claims cannot use up
        # the sockets of every other worker's subscriber (pyzmq's shared context holds 1,023 in all).
        self._ctx = zmq.asyncio.Context(io_threads=1)
        self._ctx.set(zmq.MAX_SOCKETS, _SOCKETS_PER_RANK * len(endpoints) + 4)
        self._ranks = [_Rank(endpoint, index.engine_view(of_ranks=len(endpoints))) for endpoint in endpoints]
        self._mode_logged: CacheMode | None = None
        self._closed = False
        self._emptied: deque[float] = deque()  # when the engine last reported its cache emptied (monotonic)
        self.refused: str | None = None  # why this publisher's events are no longer followed

    def start(self) -> None:
        """Subscribe to every rank; on any failure (a bad endpoint, no sockets or file descriptors left) nothing
        opened stays open, and the error is raised."""
        loop = asyncio.get_running_loop()
        try:
            for rank in self._ranks:
                sub = _bounded(self._ctx.socket(zmq.SUB))
                rank.sockets = [sub]
                sub.setsockopt(zmq.SUBSCRIBE, rank.endpoint.topic.encode())
                # A monitor address of its own: pyzmq's default names it by the socket's fd, which a socket closed a
                # moment ago may still hold (the reaper frees it later), so a new subscriber would hear no CONNECTED.
                address = f"inproc://kvgate-kv-monitor-{next(_MONITOR_IDS)}"
                sub.monitor(address, zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
                monitor = self._ctx.socket(zmq.PAIR)
                rank.sockets.append(monitor)
                monitor.setsockopt(zmq.LINGER, 0)
                monitor.connect(address)
                sub.connect(rank.endpoint.endpoint)
                rank.tasks = [loop.create_task(self._receive(rank, sub), name=f"kvgate-kv-events-{self.name}"),
                              loop.create_task(self._watch_connection(rank, monitor),
                                               name=f"kvgate-kv-monitor-{self.name}")]
                if rank.endpoint.replay_endpoint:
                    rank.tasks.append(loop.create_task(self._probe(rank), name=f"kvgate-kv-probe-{self.name}"))
        except BaseException:
            for rank in self._ranks:
                for task in rank.tasks:
                    task.cancel()  # not started yet: each ends at its first step, holding nothing
                rank.tasks = []
            self._close()
            raise

    async def stop(self) -> None:
        tasks = [task for rank in self._ranks for task in rank.tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._close()

    def _close(self) -> None:
        """Every socket closed, the context ended, the views out of the index."""
        for rank in self._ranks:
            rank.tasks = []
            if rank.sockets:
                with contextlib.suppress(zmq.ZMQError):
                    rank.sockets[0].disable_monitor()
            for socket in reversed(rank.sockets):
                socket.close(linger=0)
            rank.sockets = []
        if not self._closed:
            self._closed = True
            self._ctx.destroy(linger=0)  # any socket a replay left (closed in its finally) and the IO thread
        self.index.ranks = [view for view in self.index.ranks if all(view is not r.view for r in self._ranks)]
        self.index.mode = CacheMode.APPROXIMATE

    @property
    def mode(self) -> CacheMode:
        if self.refused is not None or not self._ranks or not all(rank.live for rank in self._ranks):
            return CacheMode.APPROXIMATE
        return CacheMode.EXACT if all(rank.complete for rank in self._ranks) else CacheMode.PARTIAL

    def _update_mode(self) -> None:
        mode = self.mode
        self.index.mode = mode
        if mode is not self._mode_logged:
            if mode is CacheMode.APPROXIMATE and self._mode_logged is not None:
                log.warning("KV events of %s: publisher down or silent; routing by what kvgate sent", self.name)
            elif mode is not CacheMode.APPROXIMATE:
                log.info("KV events of %s: %s", self.name, mode.value)
            self._mode_logged = mode
            if self._on_mode is not None:
                self._on_mode(mode)

    # ── the stream ──────────────────────────────────────────────────────────────────────────────────────────
    async def _receive(self, rank: _Rank, sub: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sub.recv_multipart()
            try:
                async with rank.lock:
                    await self._on_message(rank, frames)
            except asyncio.CancelledError:
                raise
            except Exception:  # whatever an engine sent, the subscriber goes on
                self.stats.malformed += 1
                log.exception("KV events of %s: a batch could not be applied", self.name)
            # A message already queued is received without a hand-over (pyzmq completes the future at once) and a small
            # batch never reaches _apply's slice: without this, a publisher that keeps the queue full holds the loop.
            await asyncio.sleep(0)

    def resync(self) -> None:
        """The worker's engine may have been replaced (kvgate re-verified it): its cache is empty, and its
        publisher's sequence starts again."""
        for rank in self._ranks:
            rank.next_seq = None
            rank.complete = False
        self._engine_emptied()
        self._update_mode()

    async def _on_message(self, rank: _Rank, frames: list[bytes]) -> None:
        if self.refused is not None:
            return
        if len(frames) != 3:
            self.stats.malformed += 1
            return
        try:
            seq = decode_sequence(frames[1])
        except MalformedBatch:
            self.stats.malformed += 1
            return
        expected = rank.next_seq
        streamed_before, rank.last_streamed = rank.last_streamed, seq
        if expected is not None and seq < expected:
            if not rank.reconnected and seq > streamed_before:
                return  # a batch a replay already applied, arriving late on the stream
            # The sequence restarts with the engine process.
            self.stats.restarts += 1
            log.info("KV events of %s: the publisher restarted (sequence %d after %d)", self.name, seq, expected)
            if not self._reported_emptied("sequence restarts"):
                return
            self._engine_emptied()
            expected = None
        if expected is None:
            rank.complete = seq == 0
            if seq > 0:  # subscribed late: what came before, if the publisher still has it
                rank.complete = await self._replay(rank, 0, seq, history=True)
        elif seq > expected:
            filled = await self._replay(rank, expected, seq)
            if filled:
                self.stats.gaps_replayed += 1
            else:
                self.stats.gaps_lost += 1
                rank.complete = False
        await self._apply(rank, seq, frames[2])
        self._update_mode()

    async def _apply(self, rank: _Rank, seq: int, payload: bytes, *, history: bool = False) -> bool:
        """One batch into the rank's view. `history`: a batch from before this subscription's first live one, older
        than anything kvgate sent since (a cache cleared back then says nothing of those prompts). False when the
        batch was refused (malformed, or over the caps in events.py), from its first bad event on: a batch lost, as
        a gap that could not be replayed. The view goes on, partial from here (the events it did apply were
        well-formed, and an event only ever lowers a prediction, so stopping part-way is no worse than skipping).

        One pass, event by event, a coalesced node in slices of pages, handing the loop over every few ms: the
        largest batch the caps allow never holds the loop, and no decoded event outlives its application (a batch
        kept whole would be ~1M tracked objects for the garbage collector's full passes to walk)."""
        if self.refused is not None:
            return False
        rank.next_seq = seq + 1
        rank.reconnected = False
        self.stats.batches += 1
        view = rank.view
        overflows = view.overflows
        decoder = EventDecoder(self.index.page_size)
        work = 0
        try:
            for raw in split_batch(payload):
                event = decoder.decode(raw)
                work += 1
                if isinstance(event, Stored):
                    hashes, ids, size, parent = event.block_hashes, event.token_ids, event.page_size, event.parent
                    for start in range(0, len(hashes), _APPLY_YIELD_PAGES):  # a coalesced node: a slice at a time
                        chunk = hashes[start:start + _APPLY_YIELD_PAGES]
                        view.store(chunk, parent, ids[start * size:(start + len(chunk)) * size], size)
                        parent = chunk[-1]
                        work += len(chunk)
                        if work >= _APPLY_YIELD_PAGES:
                            work = 0
                            await asyncio.sleep(0)
                elif isinstance(event, Removed):
                    hashes = event.block_hashes
                    for start in range(0, len(hashes), _APPLY_YIELD_PAGES):
                        view.remove(hashes[start:start + _APPLY_YIELD_PAGES])
                        work += min(_APPLY_YIELD_PAGES, len(hashes) - start)
                        if work >= _APPLY_YIELD_PAGES:
                            work = 0
                            await asyncio.sleep(0)
                elif isinstance(event, Cleared):
                    if not history and not self._reported_emptied("AllBlocksCleared"):
                        return False
                    self._engine_emptied(forget_sent=not history)
                    rank.complete = True
                if work >= _APPLY_YIELD_PAGES:
                    work = 0
                    await asyncio.sleep(0)
        except MalformedBatch as exc:
            self.stats.malformed += 1
            rank.complete = False
            log.debug("KV events of %s: batch %d refused: %s", self.name, seq, exc)
            return False
        finally:
            if view.overflows != overflows:  # the view was dropped: what it held before is unknown from here on
                rank.complete = False
                log.warning("KV events of %s: more pages stored than the pool holds; view dropped", self.name)
        return True

    def _reported_emptied(self, what: str) -> bool:
        """The engine reports its cache emptied; False (and its events refused from now on) when it has done so more
        than MAX_EMPTIED times in EMPTIED_WINDOW_S."""
        now = time.monotonic()
        emptied = self._emptied
        emptied.append(now)
        while emptied and emptied[0] <= now - EMPTIED_WINDOW_S:
            emptied.popleft()
        if len(emptied) <= MAX_EMPTIED:
            return True
        self.refused = (f"cache reported emptied {len(emptied)} times in {EMPTIED_WINDOW_S:.0f} s ({what}): "
                        "a faulty publisher")
        self.index.events_refused = self.refused
        log.warning("KV events of %s: %s; its events are refused, routing by what kvgate sent", self.name,
                    self.refused)
        for rank in self._ranks:  # the placement of its pages is no longer followed; the eviction marks stay
            rank.view.clear()
        self._update_mode()
        return False

    def _engine_emptied(self, *, forget_sent: bool = True) -> None:
        for rank in self._ranks:  # a flush or a restart empties every rank's cache
            rank.view.clear()
        if forget_sent:
            self.index.forget_sent()

    # ── replay ──────────────────────────────────────────────────────────────────────────────────────────────
    async def _replay(self, rank: _Rank, start: int, stop: int | None, *, history: bool = False) -> bool:
        """Apply the buffered batches from `start` (up to `stop`, exclusive, when given). True when every one of
        them arrived in order; False when the publisher no longer holds them, has no replay socket, or is silent."""
        replay = rank.endpoint.replay_endpoint
        if replay is None:
            return False
        dealer = _bounded(self._ctx.socket(zmq.DEALER))
        dealer.connect(replay)
        topic = rank.endpoint.topic.encode()
        expected = start
        complete = True
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            while True:
                async with asyncio.timeout(self._liveness_s):
                    frames = await dealer.recv_multipart()
                await asyncio.sleep(0)  # as in _receive: a replay that streams frames never holds the loop
                # (b"", seq, payload) in 0.5.8, (b"", topic, seq, payload) in 0.5.22+: the ROUTER's reply to a
                # DEALER keeps the REQ-style empty delimiter; the end marker's topic frame is empty.
                if len(frames) < 3 or frames[0] or any(f not in (b"", topic) for f in frames[1:-2]):
                    self.stats.malformed += 1
                    continue
                seq = decode_sequence(frames[-2])
                if seq == _END:
                    break
                if stop is not None and seq >= stop:
                    continue  # the live stream delivers these
                if seq < expected:
                    continue
                if seq > expected:
                    complete = False  # the buffer no longer holds what came between
                complete = await self._apply(rank, seq, frames[-1], history=history) and complete
                expected = seq + 1
            rank.answering = True
            return complete and (stop is None or expected == stop)
        except (TimeoutError, MalformedBatch, zmq.ZMQError):
            rank.answering = False
            return False
        finally:
            dealer.close(linger=0)

    async def _probe(self, rank: _Rank) -> None:
        """At once, then every `liveness_s`: is the publisher there, and did a dropped message hide batches at the
        stream's end? Before any batch arrived, everything it still buffers is asked for: a publisher whose buffer
        starts at sequence 0 (or is empty) has told kvgate its whole history."""
        while self.refused is None:
            try:
                async with rank.lock:
                    first = rank.next_seq is None
                    ok = await self._replay(rank, rank.next_seq or 0, None, history=first)
                    if first and rank.answering:
                        rank.complete = ok
                    elif not ok and rank.answering:
                        self.stats.gaps_lost += 1
                        rank.complete = False
            except asyncio.CancelledError:
                raise
            except Exception:  # whatever a replay sent, the probe goes on (a dead probe is a liveness check lost)
                self.stats.malformed += 1
                rank.complete = False
                log.exception("KV events of %s: a replay could not be applied", self.name)
            self._update_mode()
            await asyncio.sleep(self._liveness_s)

    # ── the connection ──────────────────────────────────────────────────────────────────────────────────────
    async def _watch_connection(self, rank: _Rank, monitor: zmq.asyncio.Socket) -> None:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_CONNECTED:
                rank.connected = True
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                rank.connected = False  # batches missed meanwhile are replayed as a gap on reconnect
                rank.reconnected = True
            self._update_mode()
