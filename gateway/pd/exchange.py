"""One PD request, from dispatch to the last byte: the place where kvgate's promises live.

    DISPATCHED ─ a verified connection to each half first (a half that is unreachable, or restarted as another
                 engine, fails the request before either is sent); then both sent at once with the same
                 gateway-owned rid and bootstrap_room
      ├─ prefill: read to its end (it answers only after the KV transfer), checked, its prompt count verified
      └─ decode:  streamed to a streaming client, each event checked; asked for a whole answer for a client that
                  does not stream (one read, one check: a stream costs both sides an event per token)
    RELEASE    ─ with `release: verified` (the default) no decode byte reaches the relay until prefill has answered
                 2xx and every prompt count the engines reported equals the gateway's own; `immediate` relays at once
    DONE       ─ decode sent [DONE], prefill answered 2xx with a clean body, every reported count verified
    CANCELLED  ─ any failure of either half or a count mismatch; the cancel order is fixed:
                   1. if prefill's fate is unknown (in flight, timed out, connection dropped): close it, send
                      /abort_request and wait for that answer (bounded by timeouts.abort_s)
                   2. only then close decode and send it /abort_request
                 so a decode never frees KV pages that a prefill may still be writing into.
    CLIENT GONE ─ the request keeps running until prefill has answered and decode has produced its first token
                  (no KV transfer is cut mid-way; for a whole answer: until prefill has answered 2xx, which it does
                  only after its KV transfer succeeded), then decode is closed and sent /abort_request.

The exchange runs in tasks of its own, never in the client's handler, so a disconnect cannot cancel it;
`ExchangeRegistry` keeps it alive until both halves are closed and every abort has been sent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Sequence
from typing import Any

import orjson

from gateway.errors import GatewayError
from gateway.pd.errors import (
    PromptCountMismatch,
    PromptMismatch,
    connect_failure,
    decode_may_be_victim,
    map_engine_error,
    prefill_may_be_victim,
)
from gateway.pd.events import RELAY_HIGH_WATER, ClientGone, Failure, RelayQueue
from gateway.pd.output import OutputMeter
from gateway.pd.plan import ExchangePlan
from gateway.pd.ports import EngineLink, Engines, EngineStream, TenantHold, connect_both, connect_both_now
from gateway.pd.registry import ExchangeRegistry, new_rid
from gateway.pd.release import VerifiedRelease
from gateway.pd.requests import engine_bodies, expected_counts
from gateway.pd.states import Decode, ExchangeState, Phase, Prefill
from gateway.pd.timers import IdleWatchdog, parked, stop
from routing.engines.answers import (
    check_result,
    parse_result,
    reported_cached_tokens,
    reported_prompt_tokens,
    stated_prompt_counts,
)
from routing.engines.errors import EngineBroken, EngineError, EngineRejected, EngineTimeout
from routing.pools import Lease
from routing.workers import Worker

log = logging.getLogger("kvgate.lifecycle")



class PDExchange:
    """Both halves of one request, carried out as `plan` says. Created by the serving flow; the relay reads `events`.

    The halves never tear themselves down because of something outside their own engine: every timeout is a timer
    of the exchange and every cancellation goes through `_cancel`, which keeps the order above."""

    def __init__(self, engines: Engines, lease: Lease, plan: ExchangePlan, registry: ExchangeRegistry, *,
                 tenant_pass: TenantHold | None = None) -> None:
        self.engines = engines
        self.plan = plan
        self.admitted = plan.admitted
        self.timeouts = plan.timeouts
        self._lease = lease
        self.pair = lease.pair
        self._registry = registry
        # Owns the tenant's pass from here on. A whole answer shows no output until it is all there: its most is
        # charged at once and what it did not use is given back at close (a stream is charged as it goes).
        self.output = OutputMeter(tenant_pass, reserve=0 if self.admitted.stream else self.admitted.max_new_tokens)
        self.rid = new_rid()
        self.room = registry.rooms.acquire()
        self.request_id: str | None = None  # the client-facing x-request-id (an operator's abort handle)
        self.state = ExchangeState()
        self.events = RelayQueue()
        self._release = VerifiedRelease(self.events, plan, self.state)
        self.failure: Failure | None = None
        self.mismatch: PromptMismatch | None = None
        self.client_gone = False
        self.implausible_ttft = False  # the first token came sooner than any real prefill of this prompt could
        self.prompt_tokens = self._count_for(self.pair.prefill)
        self.prefill_cached: int | None = None  # prompt tokens the prefill reported taking from its cache
        self.retries_made = 0
        self.aborts: list[tuple[str, bool]] = []  # (role, acknowledged) for every /abort_request sent
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # What happened when (monotonic seconds), for metrics, traces and the access log.
        self.started_at = time.monotonic()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.client_gone_at: float | None = None
        self.prefill_settled_at: float | None = None
        self.decode_closed_at: float | None = None
        self._ttft_judged = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._dispatch_task: asyncio.Task[None] | None = None
        self._prefill_task: asyncio.Task[None] | None = None
        self._decode_task: asyncio.Task[None] | None = None
        self._links: Sequence[EngineLink] = ()
        self._timers: list[asyncio.TimerHandle] = []
        self._watchdog = IdleWatchdog(plan.timeouts.idle_s, self._idle_timeout)  # armed by decode's first token

    # ── dispatch ────────────────────────────────────────────────────────────────────────────────────────────
    def start(self) -> None:
        self.started_at = time.monotonic()
        self._registry.running.add(self)
        loop, timeouts = asyncio.get_running_loop(), self.timeouts
        self._timers = [loop.call_later(timeouts.prefill_s, self._prefill_timeout),
                        loop.call_later(timeouts.first_token_s, self._first_token_timeout),
                        loop.call_later(timeouts.total_s, self._total_timeout)]
        links = connect_both_now(self.engines, self.pair.prefill, self.pair.decode)
        if links is not None:
            self._send(links)  # both connected already: sent from here, no dispatch task
        else:
            self._dispatch_task = self._spawn(self._dispatch())

    async def _dispatch(self) -> None:
        links = await self._connect()
        if links is not None:
            self._send(links)

    def _send(self, links: tuple[EngineLink, EngineLink]) -> None:
        """Both halves sent at once, each read in its own task."""
        prefill_link, decode_link = self._links = links
        try:
            prefill_count, decode_count = expected_counts(self.admitted, self.pair)
        except GatewayError as refusal:
            prefill_link.release()
            decode_link.release()
            self.fail(refusal)
            return
        prefill_body, decode_body = engine_bodies(self.admitted, self.pair.prefill, self.rid, self.room,
                                                  self.plan.cache_salt)
        self.state.move(Phase.SENT)
        self._prefill_task = self._spawn(self._run_prefill(prefill_link, prefill_body, prefill_count))
        self._decode_task = self._spawn(self._run_decode(decode_link, decode_body, decode_count))

    async def _connect(self) -> tuple[EngineLink, EngineLink] | None:
        """Both halves connected, on this pair or (nothing having been sent) another; None: failed."""
        tried: set[Worker] = set()
        while True:
            prefill, decode = await connect_both(self.engines, self.pair.prefill, self.pair.decode)
            if not isinstance(prefill, BaseException) and not isinstance(decode, BaseException):
                return prefill, decode
            failed: list[EngineError] = []
            for worker, link in ((self.pair.prefill, prefill), (self.pair.decode, decode)):
                if not isinstance(link, BaseException):
                    link.release()
                    continue
                if not isinstance(link, EngineError):
                    raise link
                if not isinstance(link, EngineTimeout):  # busy is not broken: health checks judge a hung engine
                    self._judge(worker, link)
                tried.add(worker)
                failed.append(link)
            if not self._retry_elsewhere(tried):
                self.fail(connect_failure(*failed))
                return None

    def _retry_elsewhere(self, tried: set[Worker]) -> bool:
        """Move to another pair with a fresh rid and room, if retries, the budget and the pool allow."""
        retries = self.plan.retries
        lease = retries.next_lease(tried, self.retries_made) if retries and self.failure is None else None
        if lease is None:
            return False
        self.retries_made += 1
        pair = lease.pair
        log.info("rid=%s: retrying on prefill %s / decode %s (%d tried)", self.rid, pair.prefill.url, pair.decode.url,
                 len(tried))
        self._lease.release()
        self._lease, self.pair = lease, pair
        rooms = self._registry.rooms
        rooms.release(self.room)
        self.rid, self.room = new_rid(), rooms.acquire()
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
        if not (isinstance(error, EngineRejected) and error.status < 500):
            self._lease.report(worker, error is None)

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
        # Nothing the exchange holds refers back to it once closed (timers, watchdog and tasks hold its bound
        # methods and coroutines): refcounting frees it at once, not the cyclic collector — each exchange left to
        # the collector made its runs frequent and slow (~10% of the gateway's CPU).
        self._timers = []
        self._watchdog.close()
        self._dispatch_task = self._prefill_task = self._decode_task = None
        self._lease.release()
        self.finished_at = time.monotonic()
        self.state.move(Phase.CLOSED)
        self._registry.rooms.release(self.room)
        self._registry.running.discard(self)
        self.closed.set_result(None)
        self.output.close()
        self._registry.on_closed(self)

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
        self._release.drop()
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
        """With the client gone, decode is closed once no KV transfer can be under way: prefill has answered and
        decode has sent its first token — or, for a whole answer (no first token to see), prefill has answered 2xx,
        which SGLang's prefill does only once its KV transfer has succeeded."""
        if self.client_gone and self.failure is None and self._decode_task is not None \
                and not self._decode_task.done() and self.state.prefill_settled \
                and (self.first_token_at is not None or (not self.admitted.stream and self.state.prefill_ok)):
            self._decode_task.cancel()

    def _prefill_timeout(self) -> None:
        if not self.state.prefill_settled:
            # A prefill waits for its decode to take the KV transfer: it is to blame only if decode got that far.
            blame = self.pair.prefill if self.first_token_at is not None else None
            self._fail_leg(blame, EngineTimeout("prefill",
                                                f"prefill did not answer within {self.timeouts.prefill_s:g}s"))

    def _first_token_timeout(self) -> None:
        # A whole answer shows no first token: once prefill has delivered, only the total time limit bounds it.
        if self.first_token_at is None and (self.admitted.stream or not self.state.prefill_ok):
            # Decode's first token needs prefill's KV: decode is to blame only if prefill has delivered.
            blame = self.pair.decode if self.state.prefill_ok else None
            self._fail_leg(blame, EngineTimeout(
                "decode", f"decode produced no first token within {self.timeouts.first_token_s:g}s"))

    def _idle_timeout(self) -> None:
        self._fail_leg(self.pair.decode, EngineTimeout("decode", f"decode sent nothing for {self.timeouts.idle_s:g}s"))

    def _total_timeout(self) -> None:
        self.fail(GatewayError(504, f"request exceeded its total time limit of {self.timeouts.total_s:g}s",
                               code="total_timeout"))

    def _fail_leg(self, blame: Worker | None, error: EngineError) -> None:
        """A failure that ends the exchange; it counts against `blame`'s breaker when that engine is provably at
        fault (None: it may be either half, e.g. a KV transfer that failed)."""
        if blame is not None and self.failure is None and self.state.sent:
            self._judge(blame, error)
        self.fail(map_engine_error(error))

    async def _cancel(self) -> None:
        """Prefill first when its fate is unknown, decode only after prefill's abort has answered."""
        prefill, decode = self.pair.prefill, self.pair.decode
        if not self.state.sent:  # still connecting: nothing reached either engine
            await stop(self._dispatch_task)
            return
        if not self.state.prefill_settled:
            await stop(self._prefill_task)
            await self._abort(prefill)
            self._settle_prefill()
        await stop(self._decode_task)
        if not self.state.decode_finished:
            await self._abort(decode)

    # ── release ─────────────────────────────────────────────────────────────────────────────────────────────
    def _maybe_release(self) -> None:
        if self.failure is None and not self.client_gone:
            self._release.advance()

    def _judge_first_token_time(self) -> bool:
        """A first token sooner than the prompt could be prefilled (integrity.ttft). Judged once both the first token
        and prefill's answer are in (a whole answer: prefill's answer alone, see below) — prefill says how many
        prompt tokens came from its radix cache, which a real prefill skips. Counted and logged; under `strict` the
        request fails (it then returns True) before any byte of it is out."""
        rule = self.plan.plausibility
        if rule is None or self._ttft_judged or not self.state.prefill_ok:
            return False
        if self.admitted.stream:
            if self.first_token_at is None:
                return False
            seen_at = self.first_token_at
        else:
            # A whole answer arrives after the whole generation, which would hide a first token that came far too
            # soon (a long max_new_tokens outlasts any floor). Prefill's own answer bounds the prompt's prefill too
            # (it answers only once its forward pass and KV transfer are done): judged on it, as soon as it is in.
            assert self.prefill_settled_at is not None
            seen_at = min(self.prefill_settled_at, self.first_token_at or self.prefill_settled_at)
        self._ttft_judged = True
        verdict = rule.judge(self.prompt_tokens, self.prefill_cached or 0, seen_at - self.started_at)
        if verdict is None:
            return False
        self.implausible_ttft = True
        log.error("implausible first token: rid=%s model=%s prefill=%s decode=%s prompt_tokens=%d uncached=%d "
                  "ttft_ms=%.1f floor_ms=%.1f strict=%s", self.rid, self.admitted.model, self.pair.prefill.url,
                  self.pair.decode.url, self.prompt_tokens, verdict.uncached_tokens, verdict.ttft_s * 1000,
                  verdict.floor_s * 1000, rule.strict)
        if rule.strict:
            self.fail(verdict.error())
        return rule.strict

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
            response = await link.generate(self.admitted.route, body, self.plan.engine_headers)
            payload = await response.body(self.plan.engine_answer_bytes)
            self._settle_prefill()
            result = parse_result("prefill", payload)
            self._verify_count("prefill", worker, reported_prompt_tokens(self.admitted.route, result), expected)
            if self.admitted.merge_logprobs:
                self._release.take_prompt_logprobs(result)
            self.prefill_cached = reported_cached_tokens(self.admitted.route, result)
            self.state.move(Prefill.OK)
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
            self._fail_leg(None if prefill_may_be_victim(error, first_token=self.first_token_at is not None)
                           else worker, error)
        except EngineError as error:
            self._fail_leg(None if prefill_may_be_victim(error, first_token=self.first_token_at is not None)
                           else worker, error)
        except Exception:  # an answer this code did not foresee must still end the request, never hang it
            log.exception("prefill answer for rid=%s could not be handled", self.rid)
            self._judge(worker, EngineBroken("prefill", "unforeseen answer"))
            self.fail(GatewayError(502, "the prefill engine's answer could not be handled", code="prefill_failed"))
        finally:
            if response is not None:
                response.close()

    def _settle_prefill(self) -> None:
        if not self.state.prefill_settled:
            self.prefill_settled_at = time.monotonic()
            self.state.move(Prefill.SETTLED)
            self._lease.prefill_done()  # its work no longer queues on the engine (the cache-aware policy weighs it)

    @property
    def output_events(self) -> int:
        """Decode events relayed or held (about one per output token when streaming)."""
        return self.output.events

    @property
    def output_bytes(self) -> int:
        """Decode payload bytes released to the relay (the prompt's logprobs included, when merged)."""
        return self._release.released_bytes

    @property
    def predicted_cached(self) -> int | None:
        """Prompt tokens the cache-aware pick expected the prefill to hold (None: no prediction made)."""
        return self._lease.predicted_cached

    # ── decode half ─────────────────────────────────────────────────────────────────────────────────────────
    async def _run_decode(self, link: EngineLink, body: Sequence[bytes | memoryview], expected: int) -> None:
        worker = self.pair.decode
        response: EngineStream | None = None
        try:
            response = await link.generate(self.admitted.route, body, self.plan.engine_headers)
            if self.admitted.stream:
                await self._read_stream(response, worker, expected)
            else:
                await self._read_whole(response, worker, expected)
            if self.plan.release_verified and not self.state.decode_counted:
                raise EngineBroken("decode", "decode never reported its prompt token count")
            # Only now is the answer whole and checked: the relay's Done (its 200's end) waits for this.
            self.state.move(Decode.FINISHED)
            self._judge(worker, None)
            self._maybe_release()
        except PromptCountMismatch as exc:
            self._judge(worker, EngineBroken("decode", str(exc)))
            self.fail(GatewayError(502, str(exc), code="prompt_token_mismatch"))
            await parked()  # keep the connection: `_cancel` closes it in the safe order
        except EngineError as error:
            victim = decode_may_be_victim(error, first_token=self.first_token_at is not None,
                                          prefill_ok=self.state.prefill_ok)
            self._fail_leg(None if victim else worker, error)
        except asyncio.CancelledError:
            if self.failure is None and not self.client_gone:
                raise
        except Exception:  # an answer this code did not foresee must still end the request, never hang it
            log.exception("decode answer for rid=%s could not be handled", self.rid)
            self._judge(worker, EngineBroken("decode", "unforeseen answer"))
            self.fail(GatewayError(502, "the decode engine's answer could not be handled", code="decode_failed"))
            await parked()
        finally:
            self._watchdog.stop()
            if response is not None:
                response.close()
            self.decode_closed_at = time.monotonic()
            if self.client_gone and self.failure is None and not self.state.decode_finished:
                self._spawn(self._abort(worker))

    async def _read_stream(self, response: EngineStream, worker: Worker, expected: int) -> None:
        """A streaming client's answer: decode's events, each checked as it comes, to its [DONE]."""
        max_event_bytes = self.plan.engine_event_bytes
        while (batch := await response.next_events(max_event_bytes)) is not None:
            self._watchdog.touch()
            for data in batch:  # the events one chunk from decode completed (usually one)
                if self.state.decode is Decode.SAID_DONE:
                    raise EngineBroken("decode", "decode sent an event after [DONE]")
                if data == b"[DONE]":
                    self.state.move(Decode.SAID_DONE)
                    continue
                first = self.first_token_at is None
                if first and await self._first_output():
                    await parked()  # failed under strict: `_cancel` closes this half in the safe order
                self._on_decode_event(data, worker, expected)
                if first:
                    self._maybe_let_go()
                    self._judge(worker, None)  # decode works: a half-open breaker's probe succeeded here
                if self.events.held_bytes > RELAY_HIGH_WATER:
                    # A slow client: stop reading from decode until it catches up. Decode's silence meanwhile is
                    # the client's doing: the idle timer waits too.
                    self._watchdog.pause()
                    await self.events.drained()
                    self._watchdog.arm()
        if self.first_token_at is None:
            raise EngineBroken("decode", "decode stream ended before its first token")
        if self.state.decode is not Decode.SAID_DONE:
            raise EngineBroken("decode", "decode stream ended without [DONE]")

    async def _read_whole(self, response: EngineStream, worker: Worker, expected: int) -> None:
        """A non-streaming client's answer, asked of decode whole: one read and one parse, where a stream would
        cost an event per token on both sides (SGLang's /generate stream repeats the whole text so far in every
        event: O(n²) bytes). Checked as one event is; its arrival stands for the first token (later than it,
        so the first-token-time judgement only gets more lenient)."""
        payload = await response.body(self.plan.engine_answer_bytes)
        if await self._first_output():
            await parked()
        self._on_decode_event(payload, worker, expected)
        self.state.move(Decode.SAID_DONE)

    async def _first_output(self) -> bool:
        """Decode's first output is in: the watchdog starts; True when the first-token-time judgement failed the
        exchange (under strict)."""
        self.first_token_at = time.monotonic()
        self.state.move(Decode.STREAMING)
        if self.admitted.stream:
            self._watchdog.arm()
        return self._judge_first_token_time()

    def _on_decode_event(self, data: bytes, worker: Worker, expected: int) -> None:
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise EngineBroken("decode", "decode sent an event that is not JSON") from None
        if not isinstance(event, dict):  # a batch's list, a bare value: not an answer to this one request
            raise EngineBroken("decode", "decode sent an event that is not a JSON object")
        # (\u: a key may be spelled escaped; a backslash is looked for first, at memchr speed)
        if b'"error"' in data or b'"abort"' in data or (b"\\" in data and b"\\u" in data):
            check_result("decode", event, data)
            # What goes on is what was checked: a key given twice keeps one value here, and so for the client.
            data = orjson.dumps(event)
        # Every count decode reports is checked, each place it states one (a key: inside a JSON string the quotes
        # are escaped, so generated text cannot pose as one).
        for count in stated_prompt_counts("decode", data):
            self._verify_count("decode", worker, count, expected)
            self.state.decode_counted = True
        self.output.observe(data)
        if not self.client_gone and self._release.offer(data):
            self._maybe_release()

    async def _abort(self, worker: Worker) -> None:
        self.aborts.append((worker.role, await self.engines.abort(worker.url, self.rid)))
