"""Request lifecycle of an SGLang PD server (0.5.8 semantics, or the fixed admission of 0.5.22+ with --no-bug).

Validation order follows SGLang: tokenizer-layer context checks, then the scheduler (missing bootstrap room, then
`max_req_input_len`). In bug mode a prompt over `max_req_input_len` is swapped for a one-token stub whose pending
400 (`to_finish`) the PD queues ignore: the prefill answers 200 after a one-token handoff, the decode answers 400 only
if it rejected too, and otherwise generates over KV pages the handoff never wrote (§2.6 of the protocol notes).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from .config import FAKE_BOOTSTRAP_HOST, EngineConfig
from .errors import HTTPError
from .faults import FaultSet
from .kvlink import Claim, DecodeLinks, RoomRegistry, RoomRejected, TransferFailed
from .kvpool import KVPool
from .metrics import Metrics
from .model import first_token, generate
from .prefill_stats import PrefillStats
from .prefix_cache import PrefixCache
from .reqlog import ABORTED, ReqRecord, RequestLog
from .tokenizer import PromptTokenizer

_REJECTS: set[asyncio.Future[None]] = set()  # transfer rejections being sent to a prefill


class Aborted(Exception):
    """The request was aborted (`/abort_request` or client disconnect) while the engine worked on it."""


class Gen:
    """One in-flight generation request."""

    __slots__ = (
        "abort_reason",
        "first",
        "hide_stub",
        "host",
        "input_ids",
        "kv_ids",
        "kv_tokens",
        "max_new",
        "max_new_given",
        "output",
        "pages",
        "port",
        "positions",
        "prompt_offset",
        "queue",
        "rec",
        "rid",
        "room",
        "task",
        "to_finish",
    )

    def __init__(self, rec: ReqRecord, input_ids: list[int], max_new: int | None, default_max_new: int,
                 host: str | None, port: int | None, room: int | None) -> None:
        self.rec = rec
        self.rid = rec.rid
        self.input_ids = input_ids
        self.kv_ids = input_ids  # what the scheduler actually runs (the stub in bug mode)
        self.max_new_given = max_new is not None
        self.max_new = default_max_new if max_new is None else max_new
        self.host = host
        self.port = port
        self.room = room
        self.to_finish: str | None = None
        self.pages: list[int] | None = None
        self.kv_tokens = 0
        self.positions: list[int] = []
        self.first = 0
        self.output: list[int] = []
        self.task: asyncio.Task[None] | None = None
        self.abort_reason: str | None = None
        self.queue = ""  # which PD queue it sits in, for the queue gauges
        self.prompt_offset = 0  # a `miscount` fault: reported prompt_tokens are off by this much
        self.hide_stub = False  # a lying engine: report the original prompt even for a bug-mode stub


class Engine:
    def __init__(self, cfg: EngineConfig, tok: PromptTokenizer) -> None:
        self.cfg = cfg
        self.tok = tok
        self.pool = KVPool(cfg.pool_tokens, cfg.page_size)
        self.metrics = Metrics(cfg.model, cfg.role)
        self.faults = FaultSet()
        self.log = RequestLog(cfg.request_log_size)
        self.kv_recorder: Any = None
        self.kv_publisher: Any = None
        events = cfg.kv_events
        if cfg.role == "prefill" and events is not None and events.publisher == "zmq":  # decodes hold no cache
            from .kv_event_publisher import ZmqEventPublisher
            from .kv_event_recorder import recorder_for

            self.kv_recorder = recorder_for(cfg.dialect)
            self.kv_publisher = ZmqEventPublisher(events, cfg.dialect)
        self.prefix_cache = PrefixCache(cfg.cache_capacity, cfg.page_size, self.kv_recorder)
        self.prefix_cache.flush()  # RadixCache.__init__ -> reset(): the first batch (seq 0) is AllBlocksCleared
        self.publish_kv_events()
        # One GPU prefills one batch at a time: prefills queue for it in arrival order (SGLang's waiting queue).
        self.timeline = asyncio.Lock()
        self.prefill_stats = PrefillStats()
        self.inflight: dict[str, Gen] = {}
        self.rooms = RoomRegistry(cfg.bootstrap_timeout_s)
        self.links = DecodeLinks()
        self.started = time.time()
        self.gen_tokens_window = [time.monotonic(), 0]  # for gen_throughput

    # admission
    def admit(self, gen: Gen) -> None:
        """Tokenizer-layer and scheduler checks; raises HTTPError for an immediate rejection."""
        cfg, L = self.cfg, len(gen.input_ids)
        if L >= cfg.context_length:
            raise HTTPError(400, f"The input ({L} tokens) is longer than the model's context length "
                                 f"({cfg.context_length} tokens).")
        if gen.max_new_given and L + gen.max_new >= cfg.context_length:
            raise HTTPError(400, f"Requested token count exceeds the model's maximum context length of "
                                 f"{cfg.context_length} tokens. You requested a total of {L + gen.max_new} tokens: "
                                 f"{L} tokens from the input messages and {gen.max_new} tokens for the completion. "
                                 f"Please reduce the number of tokens in the input messages or the completion to "
                                 f"fit within the limit.")
        if gen.room is None:
            raise HTTPError(400, "Invalid request: Disaggregated request received without boostrap room id. "
                                 f"req.rid={gen.rid}")
        if L >= cfg.max_req_input_len:
            msg = (f"Input length ({L} tokens) exceeds the maximum allowed length ({cfg.max_req_input_len} tokens). "
                   "Use a shorter input or enable --allow-auto-truncate.")
            if not cfg.bug:
                self._notify_peer_reject(gen, msg)
                raise HTTPError(400, msg)
            gen.to_finish = msg  # set_finish_with_abort: verdict pending, prompt replaced by a one-token stub
            gen.kv_ids = [0]
        gen.max_new = max(0, min(gen.max_new, cfg.max_req_len - L - 1))
        if cfg.role == "prefill":
            gen.max_new = 1

    def _notify_peer_reject(self, gen: Gen, msg: str) -> None:
        """Fixed mode: tell the other half before any transfer, so neither side waits out its timeout."""
        if gen.host == FAKE_BOOTSTRAP_HOST or gen.room is None:
            return
        if self.cfg.role == "prefill":
            self.rooms.reject_from_prefill(gen.room, msg)
        else:
            sending = self._send_reject(gen.host or "127.0.0.1", self._peer_port(gen), gen.room, msg)
            task = asyncio.ensure_future(sending)
            _REJECTS.add(task)  # kept from the garbage collector until sent
            task.add_done_callback(_REJECTS.discard)

    async def _send_reject(self, host: str, port: int, room: int, msg: str) -> None:
        try:
            (await self.links.get(host, port)).reject(room, msg)
        except OSError:
            pass  # best effort: the prefill will time out on its own

    def _peer_port(self, gen: Gen) -> int:
        return gen.port if gen.port is not None else self.cfg.bootstrap_port

    # roles
    async def run(self, gen: Gen) -> None:
        """Run admission-passed `gen` up to its output tokens (gen.output); raises HTTPError or Aborted."""
        self.inflight[gen.rid] = gen
        if self.cfg.role == "prefill":
            await self._prefill(gen)
        else:
            await self._decode(gen)

    async def _prefill(self, gen: Gen) -> None:
        cfg, room_id = self.cfg, gen.room
        assert room_id is not None
        claim: Claim | None = None
        if gen.host != FAKE_BOOTSTRAP_HOST:
            room = self.rooms.room_for_request(room_id)
            gen.queue = "bootstrap"
            try:
                # The timer starts when the request enters the bootstrap queue, after tokenization, as in SGLang.
                async with asyncio.timeout(cfg.bootstrap_timeout_s):
                    claim = await room.claim
            except TimeoutError:
                self.metrics.bootstrap_failed.inc()
                raise HTTPError(500, f"Prefill bootstrap failed for request rank=0 req.rid={gen.rid} "
                                     f"req.bootstrap_room={room_id}") from None
            except RoomRejected as e:
                raise HTTPError(400, str(e)) from None
            finally:
                self.rooms.release(room_id, room)
        await self._forward(gen)
        pos, n = gen.positions, len(gen.kv_ids)
        gen.first = first_token(self.pool, pos)
        gen.output = [gen.first]
        gen.queue = "inflight"
        if claim is not None:
            if claim.channel.transport is None or claim.channel.transport.is_closing():
                self.metrics.transfer_failed.inc()
                raise HTTPError(500, f"Prefill transfer failed for request rank=0 req.rid={gen.rid} "
                                     f"req.bootstrap_room={room_id}")
            # the Mooncake sender truncates to the destination length the decode pre-allocated
            sent = self.pool.read(pos[:min(n, claim.dst)])
            # the metadata buffer carries the prefill's cached_tokens, which the decode reports as its own
            claim.channel.send({"room": room_id, "ok": True, "ids": sent, "first": gen.first,
                                "cached": gen.rec.cached_tokens})
            gen.rec.transferred_tokens = len(sent)
        gen.queue = ""

    async def _forward(self, gen: Gen) -> None:
        """Wait for the GPU, match the prefix cache, compute the uncached tokens, cache the prompt
        (`init_next_round_input`'s match, the forward, `cache_unfinished_req`), publish the step's KV events."""
        cfg, rec, ids = self.cfg, gen.rec, gen.kv_ids
        gen.queue = "waiting"
        async with self.timeline:
            await self._alloc(gen, len(ids))  # a full pool holds the whole queue, as an unschedulable batch would
            gen.queue = ""
            rec.cached_tokens = self.prefix_cache.match(rec.extra_key, ids)
            self.metrics.cached_tokens.inc(rec.cached_tokens)
            uncached = len(ids) - rec.cached_tokens
            busy = uncached / cfg.prefill_tokens_per_s if cfg.prefill_tokens_per_s > 0 else 0.0
            if busy > 0:
                await asyncio.sleep(busy)
            self.pool.write(gen.positions, ids)
            self.prefix_cache.insert(rec.extra_key, ids)
            self.publish_kv_events()
            self.prefill_stats.step(len(ids), rec.cached_tokens, busy)

    def publish_kv_events(self) -> None:
        """`_publish_kv_events`: what the cache recorded since the last step, as one batch."""
        if self.kv_recorder is not None:
            events = self.kv_recorder.take()
            if events:
                self.kv_publisher.publish(self.kv_recorder.batch(events))

    def close_kv_events(self) -> None:
        if self.kv_publisher is not None:
            self.kv_publisher.close()

    def waiting_uncached_tokens(self) -> int:
        """Prompt tokens of the prefill's waiting queue not in the cache now (0.5.22+ `num_waiting_uncached_tokens`,
        with the radix tree's fast prefix match)."""
        return sum(len(g.kv_ids) - self.prefix_cache.peek(g.rec.extra_key, g.kv_ids)
                   for g in self.inflight.values() if g.queue == "waiting")

    async def _decode(self, gen: Gen) -> None:
        cfg, room_id = self.cfg, gen.room
        assert room_id is not None
        link = None
        if gen.host != FAKE_BOOTSTRAP_HOST:
            host, port = gen.host or "127.0.0.1", self._peer_port(gen)
            try:
                link = await self.links.get(host, port)
            except OSError:
                self.metrics.bootstrap_failed.inc()
                raise HTTPError(500, f"Decode transfer failed for request rank=0 req.rid={gen.rid} "
                                     f"req.bootstrap_room={room_id} with exception Could not fetch prefill parallel "
                                     f"info from bootstrap_addr: {host}:{port}") from None
        n = len(gen.kv_ids)
        gen.queue = "prealloc"
        # waits silently (FIFO) until the pages and the reserved decode headroom fit
        await self._alloc(gen, n + gen.max_new, reserve=cfg.num_reserved_decode_tokens)
        pos = gen.positions
        if link is not None:
            gen.queue = "transfer"
            fut = link.claim(room_id, n)
            t0 = time.monotonic()
            try:
                async with asyncio.timeout(cfg.waiting_timeout_s):
                    frame = await fut
            except TimeoutError:
                link.abort(room_id)
                self.metrics.transfer_failed.inc()
                raise HTTPError(500, f"Decode transfer failed for request rank=0 req.rid={gen.rid} "
                                     f"req.bootstrap_room={room_id} with exception Request {room_id} timed out after "
                                     f"{time.monotonic() - t0:.1f}s in KVPoll.WaitingForInput") from None
            except TransferFailed as e:
                self.metrics.transfer_failed.inc()
                raise HTTPError(e.status, f"Decode transfer failed for request rank=0 req.rid={gen.rid} "
                                          f"req.bootstrap_room={room_id} with exception {e}") from None
            except asyncio.CancelledError:
                link.abort(room_id)
                raise
            if not frame["ok"]:
                raise HTTPError(frame["status"], frame["msg"])
            ids = frame["ids"]
            self.pool.write(pos[:len(ids)], ids)
            gen.rec.transferred_tokens = len(ids)
            gen.rec.cached_tokens = frame.get("cached", 0)
            gen.first = frame["first"]
        else:
            gen.first = self.pool.slots[pos[0]]  # FAKE backend: nothing is transferred
        gen.queue = ""
        if gen.to_finish is not None:  # check_finished applies the pending abort after the first step
            raise HTTPError(400, gen.to_finish)
        gen.output = generate(self.pool, pos[:len(gen.input_ids)], gen.first, gen.max_new)
        self.pool.write(pos[n:n + len(gen.output)], gen.output)  # decode writes KV for what it generates

    async def _alloc(self, gen: Gen, tokens: int, reserve: int = 0) -> None:
        gen.pages = await self.pool.alloc(tokens, reserve)
        gen.kv_tokens = tokens
        gen.positions = self.pool.positions(gen.pages, tokens)

    def release(self, gen: Gen) -> None:
        """Free the request's pages (contents stay) and forget it."""
        if gen.pages is not None:
            self.pool.free(gen.pages, gen.kv_tokens)
            gen.pages = None
        if self.inflight.get(gen.rid) is gen:
            del self.inflight[gen.rid]

    # abort
    def abort(self, gen: Gen, reason: str) -> None:
        """Abort `gen` wherever it waits; the handler turns the cancellation into Aborted."""
        if gen.abort_reason is None and gen.rec.outcome is None:
            gen.abort_reason = reason
            self.metrics.num_aborted.inc()
            if gen.task is not None and not gen.task.done():
                gen.task.cancel()

    def abort_prefix(self, prefix: str, abort_all: bool) -> int:
        victims = [g for rid, g in self.inflight.items() if abort_all or rid.startswith(prefix)]
        for g in victims:
            self.abort(g, ABORTED)
        return len(victims)

    # load figures
    def queue_counts(self) -> dict[str, int]:
        counts = {"bootstrap": 0, "waiting": 0, "inflight": 0, "prealloc": 0, "transfer": 0, "": 0}
        for g in self.inflight.values():
            counts[g.queue] = counts.get(g.queue, 0) + 1
        return counts

    def waiting_tokens(self) -> int:
        return sum(len(g.kv_ids) for g in self.inflight.values()
                   if g.queue in ("bootstrap", "waiting", "prealloc", "transfer"))

    def note_generated(self, n: int) -> None:
        self.gen_tokens_window[1] += n

    def gen_throughput(self) -> float:
        t0, n = self.gen_tokens_window
        now = time.monotonic()
        rate = n / max(now - t0, 1e-9)
        if now - t0 > 10:
            self.gen_tokens_window[:] = [now, 0]
        return rate
