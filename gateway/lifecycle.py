"""One PD request, from dispatch to the last byte: the place where kvgate's promises live.

    DISPATCHED ─ a verified connection to each half first (a half that is unreachable, or restarted as another
                 engine, fails the request before either is sent); then both sent at once with the same
                 gateway-owned rid and bootstrap_room
      ├─ prefill: read to its end (it answers only after the KV transfer), checked, its prompt count verified
      └─ decode:  streamed (even for a non-streaming client, to see the first token), each event checked
    RELEASE    ─ with `release: verified` (the default) no decode byte reaches the relay until prefill has answered
                 2xx and every prompt count the engines reported equals the gateway's own; `immediate` relays at once
    DONE       ─ decode sent [DONE], prefill answered 2xx with a clean body, every reported count verified
    CANCELLED  ─ any failure of either half or a count mismatch; the cancel order is fixed:
                   1. if prefill's fate is unknown (in flight, timed out, connection dropped): close it, send
                      /abort_request and wait for that answer (bounded by timeouts.abort_s)
                   2. only then close decode and send it /abort_request
                 so a decode never frees KV pages that a prefill may still be writing into.
    CLIENT GONE ─ the request keeps running until prefill has answered and decode has produced its first token
                  (no KV transfer is cut mid-way), then decode is closed and sent /abort_request.

The exchange runs in tasks of its own, never in the client's handler, so a disconnect cannot cancel it; `ExchangeRegistry`
keeps it alive until both halves are closed and every abort has been sent.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import orjson

from gateway.admission.admit import AdmittedRequest
from gateway.config import TimeoutsConfig
from gateway.errors import GatewayError
from routing.engines.client import error_message
from routing.engines.errors import (EngineBroken, EngineChanged, EngineError, EngineRejected, EngineTimeout,
                                    is_length_rejection)
from routing.pools import Lease
from routing.retry_budget import RetryBudget
from routing.workers import Worker

log = logging.getLogger("kvgate.lifecycle")

Release = Literal["verified", "immediate"]


# ── what the relay receives ─────────────────────────────────────────────────────────────────────────────────
@dataclass(frozen=True, slots=True)
class Done:
    """Decode finished, prefill answered 2xx, every reported count verified: the response may be completed."""


@dataclass(frozen=True, slots=True)
class ClientGone:
    """The client disconnected; the relay stops (the exchange itself goes on as the contract says)."""


@dataclass(frozen=True, slots=True)
class Failure:
    """The first failure of an exchange, as the client will see it."""

    error: GatewayError


RelayEvent = bytes | Done | ClientGone | Failure  # bytes: one released decode event payload

# Decode payload bytes waiting for a slow client before decode stops reading from the engine (TCP backpressure).
_RELAY_HIGH_WATER = 1 << 20
_RELAY_LOW_WATER = 1 << 18
# An engine's own prompt count inside an event (a key: inside a JSON string every quote is escaped).
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens":\s*(-?\d+)')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')
_OUTPUT_STEP = 64  # output tokens between two `on_output` calls (a tenant's output budget is charged as it streams)
# How SGLang's decode words a failure of the bootstrap or the KV transfer from its prefill.
# Where a /generate event's prompt logprobs start (a key: inside a JSON string every quote is escaped).
_INPUT_LOGPROBS = re.compile(rb'"input_token_logprobs":\s*\[')
_TRANSFER_FAILURE = re.compile(r"(?i)bootstrap|transfer|prefill")
_PREFILL_TRANSFER_FAILURE = re.compile(r"(?i)bootstrap|transfer|decode")


class RelayQueue(asyncio.Queue[RelayEvent]):
    """The exchange → relay channel. It counts the payload bytes it holds, so the decode half can wait for a slow
    client instead of buffering its whole output in the gateway."""

    def __init__(self) -> None:
        super().__init__()
        self.held_bytes = 0
        self._drained = asyncio.Event()
        self._drained.set()

    def _put(self, item: RelayEvent) -> None:
        super()._put(item)
        if isinstance(item, bytes):
            self.held_bytes += len(item)
            if self.held_bytes > _RELAY_HIGH_WATER:
                self._drained.clear()

    def _get(self) -> RelayEvent:
        item = super()._get()
        if isinstance(item, bytes):
            self.held_bytes -= len(item)
            if self.held_bytes <= _RELAY_LOW_WATER:
                self._drained.set()
        return item

    async def drained(self) -> None:
        await self._drained.wait()


@dataclass(frozen=True, slots=True)
class PromptMismatch:
    """An engine reported a prompt length other than the gateway counted (never carries prompt text)."""

    role: str
    worker: str
    reported: int | None
    expected: int


@dataclass(frozen=True, slots=True)
class Retries:
    """Other pairs to try when a worker provably never got the request (its connection failed before anything was
    sent): at most `attempts` more, each allowed by the gateway's retry budget."""

    attempts: int
    repick: Callable[[Collection[Worker]], Lease | None]
    budget: RetryBudget


# ── what the lifecycle needs from the engine client (a fake one drives the in-process tests) ─────────────────
class EngineStream(Protocol):
    async def body(self) -> bytes: ...
    def events(self) -> AsyncIterator[bytes]: ...
    def close(self) -> None: ...


class EngineLink(Protocol):
    """A verified connection to one worker, reserved for one request."""

    async def generate(self, path: str, body: Sequence[bytes | memoryview],
                       headers: tuple[tuple[bytes, bytes], ...] = ()) -> EngineStream: ...
    def release(self) -> None: ...


class Engines(Protocol):
    async def connect(self, worker: Worker) -> EngineLink: ...
    async def abort(self, url: str, rid: str) -> bool: ...


def new_rid() -> str:
    return "kvg-" + secrets.token_hex(16)


class RoomAllocator:
    """Random 63-bit bootstrap rooms, never handed out twice while still in use."""

    def __init__(self) -> None:
        self._in_use: set[int] = set()

    def acquire(self) -> int:
        while True:
            room = secrets.randbits(63)
            if room not in self._in_use:
                self._in_use.add(room)
                return room

    def release(self, room: int) -> None:
        self._in_use.discard(room)


class ExchangeRegistry:
    """Owns every running exchange, so none is garbage-collected or forgotten at shutdown."""

    def __init__(self) -> None:
        self.running: set[PDExchange] = set()

    async def drain(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for every exchange to end; cancel those still running and wait until their
        halves are closed and aborted. Returns how many were cancelled."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        # Requests still being admitted or queued when the drain began join `running` later: wait for them too.
        while self.running and (remaining := deadline - loop.time()) > 0:
            await asyncio.wait([exchange.closed for exchange in self.running], timeout=remaining,
                               return_when=asyncio.FIRST_COMPLETED)
        left = list(self.running)
        for exchange in left:
            exchange.fail(GatewayError(503, "the gateway is shutting down", code="shutting_down"))
        if left:
            await asyncio.wait([exchange.closed for exchange in left])
        return len(left)


def map_engine_error(error: EngineError) -> GatewayError:
    """Engine failures → client statuses: 400 stays 400 (413 for a length rejection), a changed worker 503, other
    rejections, broken or unreachable connections 502, timeouts 504. Never 200. The client reads the role, not the
    worker's address; the whole message goes to the access log."""
    role = error.role
    match error:
        case EngineTimeout():
            status, code = 504, f"{role}_timeout"
        case EngineChanged():
            status, code = 503, "worker_changed"
        case EngineRejected(length_rejection=True):
            status, code = 413, "context_length_exceeded"
        case EngineRejected(status=400):
            status, code = 400, f"{role}_bad_request"
        case EngineRejected(status=429):
            status, code = 503, f"{role}_overloaded"
        case _:
            status, code = 502, f"{role}_failed"
    return GatewayError(status, error.public_message, code=code, detail=str(error))


def _connect_failure(error: EngineError, *also: EngineError) -> GatewayError:
    """Nothing was sent to either engine. One too busy to take or confirm a connection in time is overloaded: 503 with
    Retry-After (the client may simply retry), not a timeout of its request. The client hears of the first half's
    failure; the log gets both."""
    if isinstance(error, EngineTimeout):
        answer = GatewayError(503, f"{error.public_message}; nothing was sent, retry", code=f"{error.role}_busy")
        answer.retry_after_s = 1
    else:
        answer = map_engine_error(error)
    answer.detail = "; ".join(str(each) for each in (error, *also))
    return answer


class PDExchange:
    """Both halves of one request. Created by the proxy, which then reads `events`.

    The halves never tear themselves down because of something outside their own engine: every timeout is a timer
    of the exchange and every cancellation goes through `_cancel`, which keeps the order above."""

    def __init__(self, engines: Engines, lease: Lease, admitted: AdmittedRequest, *, timeouts: TimeoutsConfig,
                 release: Release, registry: ExchangeRegistry, rooms: RoomAllocator,
                 on_closed: Callable[[PDExchange], None] | None = None, retries: Retries | None = None,
                 engine_headers: tuple[tuple[bytes, bytes], ...] = (),
                 plausibility: TTFTPlausibility | None = None, cache_salt: str | None = None,
                 on_output: Callable[[int], None] | None = None) -> None:
        self.engines = engines
        self._lease = lease
        self.pair = pair = lease.pair
        self.admitted = admitted
        self.timeouts = timeouts
        self.rid = new_rid()
        self.request_id: str | None = None  # the client-facing x-request-id (an operator's abort handle)
        self.room = rooms.acquire()
        self.events = RelayQueue()
        self.failure: Failure | None = None
        self.mismatch: PromptMismatch | None = None
        self.client_gone = False
        self.first_token_at: float | None = None
        # What happened when (monotonic seconds), for metrics, traces and the access log.
        self.started_at = time.monotonic()
        self.finished_at: float | None = None
        self.client_gone_at: float | None = None
        self.prefill_settled_at: float | None = None
        self.decode_closed_at: float | None = None
        self.output_events = 0  # decode events relayed or held (about one per output token when streaming)
        self.output_tokens = 0  # as decode reports them (completion_tokens), cumulative
        self._on_output = on_output  # called with output_tokens every _OUTPUT_STEP tokens
        self._output_reported = 0
        self.aborts: list[tuple[str, bool]] = []  # (role, acknowledged) for every /abort_request sent
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.prompt_tokens = self._count_for(pair.prefill)
        self._release_verified = release == "verified"
        # /generate with return_logprob: only the prefill has the prompt's logprobs; they are prepended to every
        # decode event's, as SGLang's router does (merge_logprobs_in_json), so decode waits for prefill's answer.
        self._prompt_logprobs: list[Any] | None = None
        self._prompt_logprobs_json: bytes | None = None
        self._released = False
        self._held: list[bytes] = []
        self._prefill_ok = False
        self._prefill_settled = asyncio.Event()  # prefill's fate is known: it answered, or never got the request
        self._decode_counted = False
        self._decode_said_done = False  # decode sent [DONE]; nothing may follow it
        self._decode_finished = False  # decode's stream ended after [DONE] and passed every end-of-stream check
        self._done = False
        self._rooms = rooms
        self._registry = registry
        self._on_closed = on_closed
        self._retries = retries
        self._engine_headers = engine_headers  # e.g. the trace context, on both engine requests
        self._plausibility = plausibility
        self._cache_salt = cache_salt  # the engines' prefix-cache namespace (SGLang's extra_key): the tenant's
        self.implausible_ttft = False  # the first token came sooner than any real prefill of this prompt could
        self._prefill_cached: int | None = None  # prompt tokens prefill took from its radix cache (when reported)
        self._ttft_judged = False
        self._judged: set[tuple[Worker, bool]] = set()  # (worker, success) outcomes already reported
        self._tasks: set[asyncio.Task[None]] = set()
        self._dispatch_task: asyncio.Task[None] | None = None
        self._prefill_task: asyncio.Task[None] | None = None
        self._decode_task: asyncio.Task[None] | None = None
        self._sent = False
        self.retries_made = 0
        self._links: Sequence[EngineLink] = ()
        self._timers: list[asyncio.TimerHandle] = []
        self._watchdog: IdleWatchdog | None = None

    # ── dispatch ────────────────────────────────────────────────────────────────────────────────────────────
    def start(self) -> None:
        self.started_at = time.monotonic()
        self._registry.running.add(self)
        self._dispatch_task = self._spawn(self._dispatch())
        loop, timeouts = asyncio.get_running_loop(), self.timeouts
        self._timers = [loop.call_later(timeouts.prefill_s, self._prefill_timeout),
                        loop.call_later(timeouts.first_token_s, self._first_token_timeout),
                        loop.call_later(timeouts.total_s, self._total_timeout)]

    async def _dispatch(self) -> None:
        tried: set[Worker] = set()
        while True:
            links = await self._connect_pair()
            failed = [(worker, link) for worker, link in zip((self.pair.prefill, self.pair.decode), links)
                      if isinstance(link, BaseException)]
            if not failed:
                break
            for link in links:
                if not isinstance(link, BaseException):
                    link.release()
            for worker, error in failed:
                if not isinstance(error, EngineError):
                    raise error
                if not isinstance(error, EngineTimeout):  # busy is not broken: health checks judge a hung engine
                    self._judge(worker, error)
                tried.add(worker)
            # Nothing was sent to either engine: another pair may serve the request.
            if not self._retry_elsewhere(tried):
                self.fail(_connect_failure(*(error for _, error in failed)))  # type: ignore[arg-type]
                return
        prefill_link, decode_link = self._links = links  # type: ignore[assignment]
        try:
            prefill_count, decode_count = self._expected_counts()
        except GatewayError as refusal:
            prefill_link.release()
            decode_link.release()
            self.fail(refusal)
            return
        prefill_body, decode_body = self._engine_bodies()
        self._sent = True
        self._prefill_task = self._spawn(self._run_prefill(prefill_link, prefill_body, prefill_count))
        self._decode_task = self._spawn(self._run_decode(decode_link, decode_body, decode_count))

    async def _connect_pair(self) -> list[EngineLink | BaseException]:
        """Both halves at once. Cancelled meanwhile (a timeout, an operator's abort, shutdown while one half is
        still connecting), a half that did connect goes back to its pool instead of staying checked out for good."""
        connecting = [asyncio.ensure_future(self.engines.connect(worker))
                      for worker in (self.pair.prefill, self.pair.decode)]
        try:
            return await asyncio.gather(*connecting, return_exceptions=True)
        except asyncio.CancelledError:
            for task in connecting:
                if task.done() and not task.cancelled() and task.exception() is None:
                    task.result().release()
            raise

    def _retry_elsewhere(self, tried: set[Worker]) -> bool:
        """Move to another pair with a fresh rid and room, if retries, the budget and the pool allow."""
        retries = self._retries
        if retries is None or self.retries_made >= retries.attempts or self.failure is not None:
            return False
        lease = retries.repick(tried)
        if lease is None:
            return False
        if not retries.budget.withdraw():
            lease.release()
            return False
        self.retries_made += 1
        pair = lease.pair
        log.info("rid=%s: retrying on prefill %s / decode %s (%d tried)", self.rid, pair.prefill.url, pair.decode.url,
                 len(tried))
        self._lease.release()
        self._lease, self.pair = lease, pair
        self._rooms.release(self.room)
        self.rid, self.room = new_rid(), self._rooms.acquire()
        self.prompt_tokens = self._count_for(pair.prefill)
        return True

    def _count_for(self, prefill: Worker) -> int:
        identity = prefill.verified
        counted = self.admitted.prompt_tokens_for(identity.version) if identity else None
        return counted if counted is not None else self.admitted.most_prompt_tokens

    def _judge(self, worker: Worker, error: EngineError | None) -> None:
        """Report what this request said about an engine to its breaker: a success once, and a failure of the
        engine's own once (5xx, broken connection, its own timeout; it may follow a success, e.g. a stream that
        broke after its first token). A 4xx is the request's fault and says nothing."""
        if isinstance(error, EngineRejected) and error.status < 500:
            return
        key = (worker, error is None)
        if key in self._judged:
            return
        self._judged.add(key)
        worker.record_outcome(error is None, self._lease.ticket(worker))

    def _expected_counts(self) -> tuple[int, int]:
        """Each engine's prompt count as the gateway counted it for that engine's version — checked again against
        the engines as verified now, on the connections about to carry it: a limit that dropped while the request
        was counted or queued (a restart with a smaller pool, another version) must not be met with a prompt
        admitted under the old one. Raises the GatewayError to answer instead."""
        admitted = self.admitted
        counts = []
        for worker in (self.pair.prefill, self.pair.decode):
            identity = worker.verified
            counted = admitted.prompt_tokens_for(identity.version) if identity is not None else None
            if identity is None or counted is None or (
                    admitted.route == "/v1/chat/completions"
                    and identity.rendering.default_chat_template_kwargs != admitted.engine_defaults_json):
                # (a restart with other default template kwargs would render a chat that was not counted)
                raise GatewayError(503, f"the {worker.role} engine changed while the request was admitted",
                                   code="worker_changed", detail=f"{worker.role} worker {worker.url}")
            if counted >= identity.max_req_input_len:
                limit = identity.max_req_input_len - 1
                raise GatewayError(413, f"This model's maximum context length is {limit} tokens for the prompt. "
                                   f"However, your prompt resulted in {counted} tokens. Please reduce the length of "
                                   f"the prompt. (The {worker.role} engine now admits at most {limit}.)",
                                   code="context_length_exceeded", param="messages")
            if worker.role == "decode" and counted + max(admitted.max_new_tokens,
                                                         identity.reserved_decode_tokens) > identity.pool_tokens:
                output = max(admitted.max_new_tokens, identity.reserved_decode_tokens)
                raise GatewayError(413, f"This model's maximum context length is {identity.pool_tokens} tokens. "
                                   f"However, you requested {counted + output} tokens ({counted} in the messages, "
                                   f"{output} in the completion, as the decode engine reserves it). Please reduce the "
                                   "length of the messages or completion.", code="context_length_exceeded",
                                   param="max_tokens")
            counts.append(counted)
        return counts[0], counts[1]

    def _engine_bodies(self) -> tuple[tuple[memoryview, bytes], tuple[memoryview, bytes]]:
        """The admitted body plus the gateway-owned fields, spliced in as a second part: the body is neither parsed
        nor copied again (it may be megabytes)."""
        base = self.admitted.engine_body
        prefill = self.pair.prefill
        owned = b',"rid":%s,"bootstrap_room":%d,"bootstrap_host":%s,"bootstrap_port":%s' % (
            orjson.dumps(self.rid), self.room, orjson.dumps(prefill.bootstrap_host),
            orjson.dumps(prefill.bootstrap_port))
        if self._cache_salt is not None:
            owned += b',"extra_key":' + orjson.dumps(self._cache_salt)
        # The decode always streams, to see the first token; on the OpenAI routes it reports usage in every event.
        decode_extra = b',"stream":true' if self.admitted.route == "/generate" else \
            b',"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true}'
        head = memoryview(base)[:-1]
        return (head, owned + b',"stream":false}'), (head, owned + decode_extra + b"}")

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not self._tasks and not self.closed.done():
            self._close()

    def _close(self) -> None:
        for link in self._links:
            link.release()  # a half cancelled before it ran never used its connection: back to the pool
        for timer in self._timers:
            timer.cancel()
        if self._watchdog is not None:
            self._watchdog.stop()
        self._lease.release()
        self.finished_at = time.monotonic()
        self._rooms.release(self.room)
        self._registry.running.discard(self)
        self.closed.set_result(None)
        if self._on_closed is not None:
            self._on_closed(self)

    # ── outcomes ────────────────────────────────────────────────────────────────────────────────────────────
    @property
    def outcome(self) -> str:
        """How it ended: ok, client_gone, or the failure's code (decode_failed, prompt_token_mismatch, …)."""
        if self.failure is not None:
            return self.failure.error.code or f"http_{self.failure.error.status}"
        return "client_gone" if self.client_gone else "ok"

    def fail(self, error: GatewayError) -> None:
        """The first failure wins: the relay hears of it, and both halves are cancelled in the safe order."""
        if self.failure is not None:
            return
        self.failure = Failure(error)
        self._held.clear()
        self.events.put_nowait(self.failure)
        self._spawn(self._cancel())

    def disconnect(self) -> None:
        """The client went away: hold prefill to its answer and decode to its first token, then stop."""
        if self.client_gone:
            return
        self.client_gone = True
        self.client_gone_at = time.monotonic()
        self.events.put_nowait(ClientGone())
        self._maybe_let_go()

    def _maybe_let_go(self) -> None:
        """With the client gone, decode is closed once prefill has answered and decode has sent its first token."""
        if self.client_gone and self.failure is None and self.first_token_at is not None \
                and self._prefill_settled.is_set() and self._decode_task is not None and not self._decode_task.done():
            self._decode_task.cancel()

    def _prefill_timeout(self) -> None:
        if not self._prefill_settled.is_set():
            # A prefill waits for its decode to take the KV transfer: it is to blame only if decode got that far.
            blame = self.pair.prefill if self.first_token_at is not None else None
            self._fail_leg(blame, EngineTimeout("prefill", f"prefill did not answer within {self.timeouts.prefill_s:g}s"))

    def _first_token_timeout(self) -> None:
        if self.first_token_at is None:
            # Decode's first token needs prefill's KV: decode is to blame only if prefill has delivered.
            blame = self.pair.decode if self._prefill_ok else None
            self._fail_leg(blame, EngineTimeout(
                "decode", f"decode produced no first token within {self.timeouts.first_token_s:g}s"))

    def _idle_timeout(self) -> None:
        self._fail_leg(self.pair.decode, EngineTimeout("decode", f"decode sent nothing for {self.timeouts.idle_s:g}s"))

    def _fail_leg(self, blame: Worker | None, error: EngineError) -> None:
        """A failure that ends the exchange; it counts against `blame`'s breaker when that engine is provably at
        fault (None: it may be either half, e.g. a KV transfer that failed)."""
        if blame is not None and self.failure is None and self._sent:
            self._judge(blame, error)
        self.fail(map_engine_error(error))

    def _prefill_blame(self, error: EngineError) -> Worker | None:
        """A prefill that reports a failed KV transfer before decode produced anything may be the decode's victim."""
        if self.first_token_at is None and isinstance(error, EngineRejected) \
                and _PREFILL_TRANSFER_FAILURE.search(error.detail):
            return None
        return self.pair.prefill

    def _decode_blame(self, error: EngineError) -> Worker | None:
        """A decode failure before its first token while prefill has not delivered may be the KV transfer's or the
        prefill's (SGLang's decode reports a lost bootstrap or transfer as its own 500): nobody is blamed."""
        if self.first_token_at is None and not self._prefill_ok and isinstance(error, EngineRejected) \
                and _TRANSFER_FAILURE.search(error.detail):
            return None
        return self.pair.decode

    def _total_timeout(self) -> None:
        self.fail(GatewayError(504, f"request exceeded its total time limit of {self.timeouts.total_s:g}s",
                               code="total_timeout"))

    async def _cancel(self) -> None:
        """Prefill first when its fate is unknown, decode only after prefill's abort has answered."""
        prefill, decode = self.pair.prefill, self.pair.decode
        if not self._sent:  # still connecting: nothing reached either engine
            await _stop(self._dispatch_task)
            return
        if not self._prefill_settled.is_set():
            await _stop(self._prefill_task)
            await self._abort(prefill)
            self._settle_prefill()
        await _stop(self._decode_task)
        if not self._decode_finished:
            await self._abort(decode)

    # ── release ─────────────────────────────────────────────────────────────────────────────────────────────
    def _emit(self, payload: bytes) -> None:
        if self.client_gone:
            return
        if self._released:
            self.events.put_nowait(self._merged(payload))
        else:
            self._held.append(payload)
            self._maybe_release()

    def _maybe_release(self) -> None:
        if self.failure is not None or self.client_gone:
            return
        strict = self._plausibility is not None and self._plausibility.strict
        waits_for_prefill = self._release_verified or self.admitted.merge_logprobs or strict
        if not self._released and (not waits_for_prefill
                                   or (self._prefill_ok and (self._decode_counted or not self._release_verified))):
            self._released = True
            for payload in self._held:
                self.events.put_nowait(self._merged(payload))
            self._held.clear()
        if self._released and self._decode_finished and self._prefill_ok and not self._done:
            self._done = True
            self.events.put_nowait(Done())

    def _judge_first_token_time(self) -> bool:
        """A first token sooner than the prompt could be prefilled: the prompt was likely not prefilled at all (the
        incident's placeholder). Judged once both the first token and prefill's answer are in — prefill says how
        many prompt tokens came from its radix cache, which a real prefill skips. Counted and logged; under `strict`
        the request fails (it then returns True) before any byte of it is out."""
        rule = self._plausibility
        if rule is None or self._ttft_judged or self.first_token_at is None or not self._prefill_ok:
            return False
        self._ttft_judged = True
        uncached = self.prompt_tokens - (self._prefill_cached or 0)
        if uncached < rule.min_prompt_tokens:
            return False
        floor_s = uncached / rule.max_prefill_tokens_per_s
        ttft = self.first_token_at - self.started_at
        if ttft >= floor_s:
            return False
        self.implausible_ttft = True
        log.error("implausible first token: rid=%s model=%s prefill=%s decode=%s prompt_tokens=%d cached=%d "
                  "ttft_ms=%.1f floor_ms=%.1f strict=%s", self.rid, self.admitted.model, self.pair.prefill.url,
                  self.pair.decode.url, self.prompt_tokens, self._prefill_cached or 0, ttft * 1000, floor_s * 1000,
                  rule.strict)
        if not rule.strict:
            return False
        self.fail(GatewayError(502, f"the decode engine's first token came {ttft * 1000:.0f} ms after dispatch, "
                                    f"sooner than a prefill of {uncached} uncached tokens can take "
                                    f"({floor_s * 1000:.0f} ms at most {rule.max_prefill_tokens_per_s:g} tokens/s); "
                                    "nothing was released", code="implausible_ttft"))
        return True

    def _merged(self, payload: bytes) -> bytes:
        """A decode event with the prefill's prompt logprobs in front of its own (only when asked for). The prompt's
        list is encoded once and spliced in: every streamed event carries it, and it may be long."""
        if self._prompt_logprobs is None:
            return payload
        if self._prompt_logprobs_json is None:
            self._prompt_logprobs_json = orjson.dumps(self._prompt_logprobs)[1:-1]
        found = _INPUT_LOGPROBS.search(payload)
        if found is None or not self._prompt_logprobs_json:
            return payload  # the engine sent no list to extend (or there is nothing to add)
        at = found.end()
        glue = b"" if payload[at:at + 1] == b"]" else b","
        return payload[:at] + self._prompt_logprobs_json + glue + payload[at:]

    def _verify_count(self, role: str, worker: Worker, reported: int | None, expected: int) -> None:
        if reported == expected:
            return
        self.mismatch = PromptMismatch(role, worker.url, reported, expected)
        log.error("prompt token mismatch: rid=%s model=%s prefill=%s decode=%s role=%s engine_count=%s "
                  "gateway_count=%s", self.rid, self.admitted.model, self.pair.prefill.url, self.pair.decode.url,
                  role, reported, expected)
        raise PromptCountMismatch(
            f"the {role} engine reported {reported} prompt tokens where the gateway counted "
            f"{expected}; the request was cancelled before any output was released")

    # ── prefill half ────────────────────────────────────────────────────────────────────────────────────────
    async def _run_prefill(self, link: EngineLink, body: Sequence[bytes | memoryview], expected: int) -> None:
        worker = self.pair.prefill
        response: EngineStream | None = None
        try:
            response = await link.generate(self.admitted.route, body, self._engine_headers)
            payload = await response.body()
            self._settle_prefill()
            result = _parse_result("prefill", payload)
            self._verify_count("prefill", worker, _reported_prompt_tokens(self.admitted.route, result), expected)
            if self.admitted.merge_logprobs:
                meta = result.get("meta_info")
                logprobs = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
                self._prompt_logprobs = logprobs if isinstance(logprobs, list) else []
            self._prefill_cached = _reported_cached_tokens(self.admitted.route, result)
            self._prefill_ok = True
            self._judge(worker, None)
            if self._judge_first_token_time():
                return
            self._maybe_release()
            self._maybe_let_go()
        except PromptCountMismatch as exc:
            self._judge(worker, EngineBroken("prefill", str(exc)))
            self.fail(GatewayError(502, str(exc), code="prompt_token_mismatch"))
        except EngineRejected as error:
            self._settle_prefill()  # it answered
            self._fail_leg(self._prefill_blame(error), error)
        except EngineError as error:
            self._fail_leg(self._prefill_blame(error), error)
        except Exception:  # an answer this code did not foresee must still end the request, never hang it
            log.exception("prefill answer for rid=%s could not be handled", self.rid)
            self._judge(worker, EngineBroken("prefill", "unforeseen answer"))
            self.fail(GatewayError(502, "the prefill engine's answer could not be handled", code="prefill_failed"))
        finally:
            if response is not None:
                response.close()

    # ── decode half ─────────────────────────────────────────────────────────────────────────────────────────
    async def _run_decode(self, link: EngineLink, body: Sequence[bytes | memoryview], expected: int) -> None:
        worker = self.pair.decode
        response: EngineStream | None = None
        try:
            response = await link.generate(self.admitted.route, body, self._engine_headers)
            async for data in response.events():
                if self._watchdog is not None:
                    self._watchdog.touch()
                if self._decode_said_done:
                    raise EngineBroken("decode", "decode sent an event after [DONE]")
                if data == b"[DONE]":
                    self._decode_said_done = True
                    continue
                first = self.first_token_at is None
                if first:
                    self.first_token_at = time.monotonic()
                    self._watchdog = IdleWatchdog(self.timeouts.idle_s, self._idle_timeout)
                    if self._judge_first_token_time():
                        await _parked()  # failed under strict: `_cancel` closes this half in the safe order
                self._on_decode_event(data, worker, expected)
                if first:
                    self._maybe_let_go()
                if first:
                    self._judge(worker, None)  # decode works: a half-open breaker's probe succeeded here
                if self.events.held_bytes > _RELAY_HIGH_WATER:
                    # A slow client: stop reading from decode until it catches up. Decode's silence meanwhile is
                    # the client's doing: the idle timer waits too.
                    self._watchdog.pause()
                    await self.events.drained()
                    self._watchdog.resume()
            if self.first_token_at is None:
                raise EngineBroken("decode", "decode stream ended before its first token")
            if not self._decode_said_done:
                raise EngineBroken("decode", "decode stream ended without [DONE]")
            if self._release_verified and not self._decode_counted:
                raise EngineBroken("decode", "decode never reported its prompt token count")
            # Only now is the answer whole and checked: the relay's Done (its 200's end) waits for this.
            self._decode_finished = True
            self._judge(worker, None)
            self._maybe_release()
        except PromptCountMismatch as exc:
            self._judge(worker, EngineBroken("decode", str(exc)))
            self.fail(GatewayError(502, str(exc), code="prompt_token_mismatch"))
            await _parked()  # keep the connection: `_cancel` closes it in the safe order
        except EngineError as error:
            self._fail_leg(self._decode_blame(error), error)
        except asyncio.CancelledError:
            if self.failure is None and not self.client_gone:
                raise
        except Exception:  # an answer this code did not foresee must still end the request, never hang it
            log.exception("decode stream for rid=%s could not be handled", self.rid)
            self._judge(worker, EngineBroken("decode", "unforeseen answer"))
            self.fail(GatewayError(502, "the decode engine's answer could not be handled", code="decode_failed"))
            await _parked()
        finally:
            if self._watchdog is not None:
                self._watchdog.stop()
            if response is not None:
                response.close()
            self.decode_closed_at = time.monotonic()
            if self.client_gone and self.failure is None and not self._decode_finished:
                self._spawn(self._abort(worker))

    def _on_decode_event(self, data: bytes, worker: Worker, expected: int) -> None:
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise EngineBroken("decode", "decode sent an event that is not JSON") from None
        if not isinstance(event, dict):  # a batch's list, a bare value: not an answer to this one request
            raise EngineBroken("decode", "decode sent an event that is not a JSON object")
        if b'"error"' in data or b'"abort"' in data:
            _parse_result("decode", data)
        # Every count decode reports is checked, each place it states one (a key: inside a JSON string the quotes
        # are escaped, so generated text cannot pose as one).
        for match in _PROMPT_TOKENS.finditer(data):
            self._verify_count("decode", worker, int(match[1]), expected)
            self._decode_counted = True
        self.output_events += 1
        if self._on_output is not None:
            self._count_output(data)
        self._emit(data)

    def _count_output(self, data: bytes) -> None:
        match = _COMPLETION_TOKENS.search(data)
        tokens = int(match[1]) if match is not None else self.output_tokens + 1
        if tokens > self.output_tokens:
            self.output_tokens = tokens
            if tokens - self._output_reported >= _OUTPUT_STEP:
                self._output_reported = tokens
                assert self._on_output is not None
                self._on_output(tokens)

    async def _abort(self, worker: Worker) -> None:
        self.aborts.append((worker.role, await self.engines.abort(worker.url, self.rid)))

    def _settle_prefill(self) -> None:
        if not self._prefill_settled.is_set():
            self.prefill_settled_at = time.monotonic()
            self._prefill_settled.set()
            self._lease.prefill_done()  # its work no longer queues on the engine (the cache-aware policy weighs it)

    @property
    def predicted_cached(self) -> int | None:
        """Prompt tokens the cache-aware pick expected the prefill to hold (None: no prediction made)."""
        return self._lease.predicted_cached

    @property
    def prefill_cached(self) -> int | None:
        """Prompt tokens the prefill reported taking from its cache (None: not reported)."""
        return self._prefill_cached


@dataclass(frozen=True, slots=True)
class TTFTPlausibility:
    """A model's ceiling on prefill speed: a first token sooner than prompt_tokens / max_prefill_tokens_per_s is not
    a real prefill (judged for prompts of at least `min_prompt_tokens`)."""

    max_prefill_tokens_per_s: float
    min_prompt_tokens: int = 1024
    strict: bool = False


class PromptCountMismatch(Exception):
    """An engine's own prompt count differs from the gateway's: the request must not produce output."""


class IdleWatchdog:
    """Calls `on_idle` after `idle_s` without `touch()`. One timer per idle period, re-armed lazily, because
    re-arming a timer on every chunk would cost more than the relay itself."""

    def __init__(self, idle_s: float, on_idle: Callable[[], None]) -> None:
        self._idle_s = idle_s
        self._on_idle = on_idle
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self._timer: asyncio.TimerHandle | None = self._loop.call_at(self._last + idle_s, self._check)

    def touch(self) -> None:
        self._last = self._loop.time()

    def pause(self) -> None:
        """No timeout until `resume()`."""
        self.stop()

    def resume(self) -> None:
        self._last = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_at(self._last + self._idle_s, self._check)

    def _check(self) -> None:
        deadline = self._last + self._idle_s
        if self._loop.time() < deadline:
            self._timer = self._loop.call_at(deadline, self._check)
            return
        self._timer = None
        self._on_idle()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


async def _parked() -> None:
    """Wait until cancelled."""
    await asyncio.get_running_loop().create_future()


async def _stop(task: asyncio.Task[None] | None) -> None:
    """Cancel a half and wait until it has closed its connection."""
    if task is None or task is asyncio.current_task():
        return
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _parse_result(role: Literal["prefill", "decode"], payload: bytes) -> dict[str, Any]:
    """The engine's JSON result; an error or abort inside a 2xx (SGLang 0.5.8 answers 200 for a prompt it
    swapped, and may answer 2xx in its OpenAI error shape) is a rejection."""
    try:
        parsed = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise EngineBroken(role, f"{role} answered 2xx with a body that is not JSON") from exc
    if not isinstance(parsed, dict):
        raise EngineBroken(role, f"{role} answered with unexpected JSON")
    if "error" in parsed or parsed.get("object") == "error":
        message = error_message(payload)
        error = parsed.get("error", parsed)
        code = error.get("code") if isinstance(error, dict) else None
        status = code if isinstance(code, int) and 400 <= code < 600 else 502
        raise EngineRejected(role, f"{role} reported an error: {message}", status=status, detail=message)
    meta = parsed.get("meta_info")
    finish = meta.get("finish_reason") if isinstance(meta, dict) else None
    if isinstance(finish, dict) and finish.get("type") == "abort":
        message = str(finish.get("message") or "request aborted")
        status = finish.get("status_code") if isinstance(finish.get("status_code"), int) else 502
        raise EngineRejected(role, f"{role} aborted the request: {message}",
                             status=400 if is_length_rejection(message) else status, detail=message)
    choices = parsed.get("choices") or []
    if not isinstance(choices, list):
        raise EngineBroken(role, f"{role} answered with malformed choices")
    for choice in choices:
        if isinstance(choice, dict) and choice.get("finish_reason") == "abort":
            raise EngineRejected(role, f"{role} aborted the request", status=502)
    return parsed


def _reported_cached_tokens(route: str, result: Any) -> int | None:
    """Prompt tokens the engine took from its prefix cache: `meta_info.cached_tokens` on /generate,
    `usage.prompt_tokens_details.cached_tokens` on OpenAI routes."""
    if not isinstance(result, dict):
        return None
    if route == "/generate":
        meta = result.get("meta_info")
        value = meta.get("cached_tokens") if isinstance(meta, dict) else None
    else:
        usage = result.get("usage")
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _reported_prompt_tokens(route: str, result: Any) -> int | None:
    """The engine's own prompt count: `meta_info.prompt_tokens` on /generate, `usage.prompt_tokens` on OpenAI."""
    if not isinstance(result, dict):
        return None
    holder = result.get("meta_info") if route == "/generate" else result.get("usage")
    value = holder.get("prompt_tokens") if isinstance(holder, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None
