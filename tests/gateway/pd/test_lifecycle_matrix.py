"""The PD lifecycle contract in-process, in milliseconds: every phase (before prefill ends, between prefill and the
first token, mid-stream) × every event (client gone, prefill fails, decode fails, timeout), plus verify-then-release.
Fake engines record, in order, every request, close and abort the exchange makes."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest

from gateway.admission.admit import AdmittedRequest
from gateway.admission.dialects import Dialect
from gateway.admission.requests import UsageOptions
from gateway.config import TimeoutsConfig
from gateway.integrity.ttft import TTFTPlausibility
from gateway.pd.events import ClientGone, Done, Failure, RelayEvent
from gateway.pd.exchange import PDExchange
from gateway.pd.plan import ExchangePlan, Release
from gateway.pd.registry import ExchangeRegistry
from routing.breaker import BreakerSpec, BreakerState
from routing.engines.errors import (
    EngineBroken,
    EngineChanged,
    EngineError,
    EngineRejected,
    EngineTimeout,
    EngineUnreachable,
)
from routing.engines.identity import EngineIdentity, RenderingSettings
from routing.pools import Lease, WorkerPair
from routing.workers import Worker, WorkerSpec
from tests.fake_engines import END, FakeEngines

COUNT = 10
FAST = TimeoutsConfig(connect_s=1, prefill_s=0.3, first_token_s=0.3, idle_s=0.2, total_s=5, abort_s=1)


def _worker(url: str, role: str) -> Worker:
    worker = Worker(WorkerSpec(url, role, 8998 if role == "prefill" else None))  # type: ignore[arg-type]
    worker.accept(EngineIdentity(100_000, 8185, 1, "0.5.23", role, "glm-5", "/t", None))
    return worker


def _event(tokens: int = COUNT, text: str = "x") -> bytes:
    return orjson.dumps({"text": text, "meta_info": {"prompt_tokens": tokens, "finish_reason": None}})


class Run:
    """One exchange over fake engines, with the relay's view of it."""

    def __init__(self, release: Release = "verified", timeouts: TimeoutsConfig = FAST,
                 merge_logprobs: bool = False, plausibility: TTFTPlausibility | None = None,
                 admitted: AdmittedRequest | None = None) -> None:
        prefill, decode = _worker("http://p", "prefill"), _worker("http://d", "decode")
        self.engines = FakeEngines(prefill, decode)
        admitted = admitted or AdmittedRequest("/generate", "glm-5", True, b'{"text":"hi","sampling_params":{}}',
                                               {Dialect.V0_5_23: COUNT}, 4, UsageOptions(),
                                               merge_logprobs=merge_logprobs)
        self.exchange = PDExchange(self.engines, Lease(WorkerPair(prefill, decode)),
                                   ExchangePlan(admitted, timeouts=timeouts, release=release,
                                                plausibility=plausibility), ExchangeRegistry())
        self.prefill, self.decode = self.engines.prefill, self.engines.decode

    async def start(self) -> None:
        self.exchange.start()
        await asyncio.wait_for(asyncio.gather(self.prefill.requested.wait(), self.decode.requested.wait()), 1)

    def relayed(self) -> list[RelayEvent]:
        queue, out = self.exchange.events, []
        while not queue.empty():
            out.append(queue.get_nowait())
        return out

    async def finished(self) -> list[tuple[str, str]]:
        await asyncio.wait_for(self.exchange.closed, 2)
        return self.engines.log

    async def prefill_answers(self, tokens: int = COUNT) -> None:
        self.prefill.accept()
        self.prefill.push(orjson.dumps({"text": "", "meta_info": {"prompt_tokens": tokens}}), END)
        await _settle()

    async def first_token(self) -> None:
        self.decode.accept()
        self.decode.push(_event())
        await _settle()


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def _run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


def _after(log: list[tuple[str, str]], first: tuple[str, str], then: tuple[str, str]) -> bool:
    return first in log and then in log and log.index(first) < log.index(then)


# ── verify, then release ──────────────────────────────────────────────────────────────────────────────────────
def test_no_decode_byte_is_released_before_prefill_answered_and_counts_verified() -> None:
    async def scenario() -> None:
        run = Run()
        await run.start()
        await run.first_token()
        run.decode.push(_event(text="xy"))
        await _settle()
        assert run.relayed() == []  # held: prefill has not answered
        await run.prefill_answers()
        assert run.relayed() == [_event(), _event(text="xy")]
        run.decode.push(b"[DONE]", END)
        log = await run.finished()
        assert run.relayed() == [Done()]
        assert ("abort", "prefill") not in log and ("abort", "decode") not in log
        # The engines got the gateway-owned fields, spliced into the admitted body.
        prefill_body, decode_body = run.prefill.bodies[0], run.decode.bodies[0]
        assert prefill_body["stream"] is False and decode_body["stream"] is True
        assert prefill_body["rid"] == decode_body["rid"] == run.exchange.rid
        assert prefill_body["bootstrap_room"] == decode_body["bootstrap_room"] == run.exchange.room
    _run(scenario)


@pytest.mark.parametrize("liar", ["prefill", "decode"])
def test_an_engine_count_that_differs_cancels_both_halves_with_zero_bytes_released(liar: str) -> None:
    async def scenario() -> None:
        run = Run()
        await run.start()
        run.decode.accept()
        run.decode.push(_event(tokens=COUNT + 3 if liar == "decode" else COUNT))
        await run.prefill_answers(tokens=COUNT + 3 if liar == "prefill" else COUNT)
        log = await run.finished()
        events = run.relayed()
        assert len(events) == 1 and isinstance(events[0], Failure)
        assert events[0].error.status == 502 and events[0].error.code == "prompt_token_mismatch"
        assert run.exchange.mismatch is not None and run.exchange.mismatch.role == liar
        assert run.exchange.mismatch.reported == COUNT + 3 and run.exchange.mismatch.expected == COUNT
        assert ("abort", "decode") in log and ("close", "decode") in log
    _run(scenario)


def test_a_prefill_that_reports_no_count_is_not_trusted() -> None:
    async def scenario() -> None:
        run = Run()
        await run.start()
        await run.first_token()
        run.prefill.accept()
        run.prefill.push(b'{"text": ""}', END)
        await run.finished()
        assert [type(e) for e in run.relayed()] == [Failure]
    _run(scenario)


def test_immediate_release_relays_before_prefill_but_still_fails_a_mismatch() -> None:
    async def scenario() -> None:
        run = Run(release="immediate")
        await run.start()
        await run.first_token()
        assert run.relayed() == [_event()]
        await run.prefill_answers(tokens=COUNT + 1)
        await run.finished()
        events = run.relayed()
        assert isinstance(events[-1], Failure) and events[-1].error.code == "prompt_token_mismatch"
    _run(scenario)


@pytest.mark.parametrize("body", [b'{"object": "error", "message": "boom", "type": "x", "code": 500}',
                                  b'{"error": {"message": "boom"}}',
                                  b'{"text": "", "meta_info": {"prompt_tokens": 10, "finish_reason": '
                                  b'{"type": "abort", "message": "Input length exceeds the maximum allowed length"}}}',
                                  b'not json'])
def test_an_error_shaped_prefill_2xx_is_a_failure(body: bytes) -> None:
    async def scenario() -> None:
        run = Run()
        await run.start()
        await run.first_token()
        run.prefill.accept()
        run.prefill.push(body, END)
        await run.finished()
        events = run.relayed()
        assert len(events) == 1 and isinstance(events[0], Failure) and events[0].error.status != 200
    _run(scenario)


@pytest.mark.parametrize("event", [b'{"\\u0065rror": {"message": "boom"}}',
                                   b'{"text": "", "meta_info": {"prompt_tokens": 10, "finish_reason": '
                                   b'{"type": "\\u0061bort", "message": "scheduler aborted it"}}}'])
def test_a_decode_error_or_abort_spelled_with_escapes_is_still_a_failure(event: bytes) -> None:
    async def scenario() -> None:
        run = Run()
        await run.start()
        await run.prefill_answers()
        await run.first_token()
        run.decode.push(event)
        run.decode.push(b"[DONE]", END)
        await run.finished()
        events = run.relayed()
        assert isinstance(events[-1], Failure) and not any(isinstance(e, Done) for e in events)
    _run(scenario)


def test_a_decode_event_with_a_key_given_twice_goes_out_as_it_was_checked() -> None:
    async def scenario() -> None:
        run = Run()
        await run.start()
        await run.prefill_answers()
        await run.first_token()
        run.decode.push(b'{"text": "xy", "meta_info": {"prompt_tokens": %d, "finish_reason": {"type": "abort"}, '
                        b'"finish_reason": null}}' % COUNT)
        run.decode.push(b"[DONE]", END)
        await run.finished()
        relayed = [e for e in run.relayed() if isinstance(e, bytes)]
        assert relayed and not any(b"abort" in e for e in relayed)  # a client keeping the first value sees no abort
    _run(scenario)


# ── the matrix: phase × event ─────────────────────────────────────────────────────────────────────────────────
PHASES = ["before_prefill_ends", "before_first_token", "mid_stream"]


async def _reach(run: Run, phase: str) -> None:
    await run.start()
    if phase in ("before_first_token", "mid_stream"):
        await run.prefill_answers()
    if phase == "mid_stream":
        await run.first_token()
        assert run.relayed() == [_event()]


@pytest.mark.parametrize("phase", PHASES)
def test_client_gone_holds_prefill_to_its_answer_and_decode_to_its_first_token_then_aborts_decode(phase: str) -> None:
    async def scenario() -> None:
        run = Run()
        await _reach(run, phase)
        run.exchange.disconnect()
        await _settle()
        if phase != "mid_stream":
            assert ("close", "decode") not in run.engines.log  # still held for its first token
            await run.first_token()
        if phase == "before_prefill_ends":
            # Prefill is still held for its answer, and decode with it: closing decode could free KV pages
            # that the prefill is still writing into.
            assert ("close", "prefill") not in run.engines.log and ("close", "decode") not in run.engines.log
            await run.prefill_answers()
        log = await run.finished()
        assert ("abort", "decode") in log and _after(log, ("close", "decode"), ("abort", "decode"))
        assert ("abort", "prefill") not in log
        assert isinstance(run.relayed()[-1], ClientGone) and run.exchange.failure is None
    _run(scenario)


def test_prefill_failure_with_unknown_fate_aborts_prefill_before_decode_is_released() -> None:
    async def scenario() -> None:
        run = Run()
        run.engines.abort_delay_s = 0.05
        await _reach(run, "before_prefill_ends")
        await run.first_token()
        run.prefill.accept()
        run.prefill.push(EngineBroken("prefill", "connection dropped mid-answer"))
        log = await run.finished()
        assert [type(e) for e in run.relayed()] == [Failure]
        # Prefill closed and its abort answered before decode was closed and aborted.
        assert _after(log, ("abort answered", "prefill"), ("close", "decode"))
        assert _after(log, ("close", "decode"), ("abort", "decode"))
    _run(scenario)


@pytest.mark.parametrize("phase", PHASES)
def test_decode_failure_cancels_both_halves_in_the_safe_order(phase: str) -> None:
    async def scenario() -> None:
        run = Run()
        await _reach(run, phase)
        if phase == "mid_stream":
            run.decode.push(EngineBroken("decode", "stream dropped"))
        else:
            run.decode.reject(EngineRejected("decode", "decode answered 503", status=503))
        log = await run.finished()
        events = run.relayed()
        assert isinstance(events[-1], Failure) and events[-1].error.status == 502
        assert not any(isinstance(e, Done) for e in events)
        if phase == "before_prefill_ends":
            assert _after(log, ("abort answered", "prefill"), ("abort", "decode"))
        else:
            assert ("abort", "prefill") not in log
    _run(scenario)


@pytest.mark.parametrize("phase", PHASES)
def test_timeouts_in_each_phase_end_with_504_and_abort(phase: str) -> None:
    async def scenario() -> None:
        run = Run()
        await _reach(run, phase)
        # Nothing more arrives: prefill, first-token or idle timeout fires.
        log = await run.finished()
        events = run.relayed()
        assert isinstance(events[-1], Failure) and events[-1].error.status == 504
        assert ("abort", "decode") in log
        if phase == "before_prefill_ends":
            assert _after(log, ("abort answered", "prefill"), ("close", "decode"))
    _run(scenario)


def test_total_timeout_fails_a_slow_but_alive_stream() -> None:
    async def scenario() -> None:
        run = Run(timeouts=FAST.model_copy(update={"total_s": 0.2, "idle_s": 5}))
        await _reach(run, "mid_stream")
        for _ in range(6):
            run.decode.push(_event())
            await asyncio.sleep(0.05)
        await run.finished()
        events: list[Any] = run.relayed()
        assert isinstance(events[-1], Failure) and events[-1].error.code == "total_timeout"
    _run(scenario)


@pytest.mark.parametrize(("role", "error", "status"), [
    ("prefill", EngineChanged("prefill", "restarted with another pool"), 503),
    ("decode", EngineUnreachable("decode", "connection refused"), 502),
    # Too busy to confirm a new connection in time: overload, nothing sent — 503 with Retry-After, not a 504.
    ("decode", EngineTimeout("decode", "did not confirm its identity within 5s"), 503)])
def test_a_half_that_cannot_be_connected_fails_the_request_before_either_half_is_sent(
        role: str, error: EngineError, status: int) -> None:
    async def scenario() -> None:
        run = Run()
        run.engines.fail_connect(role, error)
        run.exchange.start()
        log = await run.finished()
        events = run.relayed()
        assert len(events) == 1 and isinstance(events[0], Failure) and events[0].error.status == status
        if isinstance(error, EngineTimeout):
            assert events[0].error.code == "decode_busy" and events[0].error.retry_after_s == 1
        assert ("request", "prefill") not in log and ("request", "decode") not in log
        other = "decode" if role == "prefill" else "prefill"
        assert ("released unused", other) in log
        assert not any(kind == "abort" for kind, _ in log)
    _run(scenario)


@pytest.mark.parametrize("hung", ["prefill", "decode"])
def test_a_half_still_connecting_at_the_timeout_leaves_the_other_halfs_connection_in_its_pool(hung: str) -> None:
    async def scenario() -> None:
        run = Run()
        run.engines.hang_connect(hung)
        run.exchange.start()
        log = await run.finished()  # the prefill timeout (0.3 s) ends it while one half is still connecting
        events = run.relayed()
        assert len(events) == 1 and isinstance(events[0], Failure) and events[0].error.code == "prefill_timeout"
        other = "decode" if hung == "prefill" else "prefill"
        assert ("released unused", other) in log  # not checked out for good
        assert not any(kind in ("request", "abort") for kind, _ in log)
    _run(scenario)


# ── what the hostile review found ────────────────────────────────────────────────────────────────────────────
def test_a_count_admitted_under_an_old_limit_is_refused_at_dispatch_before_either_half_is_sent() -> None:
    async def scenario() -> None:
        run = Run()
        # Between admission and dispatch the prefill restarted with a small pool and was verified again.
        run.exchange.pair.prefill.accept(EngineIdentity(4096, 6, 1, "0.5.23", "prefill", "glm-5", "/t", None))
        run.exchange.start()
        log = await run.finished()
        events = run.relayed()
        assert isinstance(events[0], Failure) and events[0].error.status == 413
        assert ("request", "prefill") not in log and ("request", "decode") not in log
    _run(scenario)


def test_a_chat_counted_under_other_engine_default_kwargs_is_refused_at_dispatch_before_either_half_is_sent() -> None:
    """Counted with the defaults in force at admission; while it queued, the engines restarted with others and were
    verified again: they would render a chat nobody counted."""
    async def scenario() -> None:
        run = Run(admitted=AdmittedRequest("/v1/chat/completions", "glm-5", False, b'{"messages":[]}',
                                           {Dialect.V0_5_23: COUNT}, 4, UsageOptions(), engine_defaults_json=None))
        for worker in (run.exchange.pair.prefill, run.exchange.pair.decode):
            identity = worker.verified
            assert identity is not None
            worker.accept(dataclasses.replace(identity, rendering=RenderingSettings(
                default_chat_template_kwargs='{"clear_thinking": false}')))
        run.exchange.start()
        log = await run.finished()
        events = run.relayed()
        assert isinstance(events[0], Failure) and events[0].error.code == "worker_changed"
        assert ("request", "prefill") not in log and ("request", "decode") not in log
    _run(scenario)


@pytest.mark.parametrize(("events", "why"), [
    ([b"[DONE]"], "no first token"),
    ([orjson.dumps({"text": "x", "meta_info": {"finish_reason": None}}), b"[DONE]"], "no count at all"),
    ([_event(), _event(tokens=COUNT + 5000), b"[DONE]"], "a later count that differs"),
    ([_event(), b"[DONE]", _event(tokens=COUNT + 5000)], "a differing count after [DONE]"),
    ([_event(), b"[DONE]", _event()], "any event after [DONE]"),
    ([_event(), b'{"choices": [{"index": 0, "delta"', b"[DONE]"], "an event that is not JSON"),
])
def test_a_decode_stream_that_cannot_be_verified_is_a_failure_not_a_200(events: list[bytes], why: str) -> None:
    async def scenario() -> None:
        run = Run()
        await run.start()
        await run.prefill_answers()
        run.decode.accept()
        run.decode.push(*events, END)
        await run.finished()
        relayed = run.relayed()
        assert not any(isinstance(e, Done) for e in relayed), why
        assert isinstance(relayed[-1], Failure) and relayed[-1].error.status == 502, why
    _run(scenario)


@pytest.mark.parametrize(("events", "why"), [
    ([orjson.dumps({"text": "x", "meta_info": {"finish_reason": None}}), b"[DONE]"], "no count at all"),
    ([b"[DONE]"], "no first token"),
    ([_event(), b"[DONE]", _event(tokens=COUNT + 500)], "an event after [DONE]"),
    ([_event(), b"[DONE]", b'{"error": {"message": "late", "code": 500}}'], "an error after [DONE]"),
    ([b'{"choices": [{"index": 0, "delta"'], "an event that is not JSON"),
    ([orjson.dumps([{"text": "x", "meta_info": {"prompt_tokens": COUNT}}])], "a batch's list"),
    ([orjson.dumps({"text": "x", "meta_info": {"prompt_tokens": COUNT}, "usage": {"prompt_tokens": COUNT + 9}})],
     "a second count that differs"),
])
def test_prefill_answering_while_decode_is_still_open_releases_nothing_unchecked(events: list[bytes],
                                                                                 why: str) -> None:
    """Prefill's answer arrives after decode's events but before decode's stream has ended: the answer is whole
    and checked only when that stream ends, so no Done (the end of a 200) may be queued before it."""
    async def scenario() -> None:
        run = Run()
        await run.start()
        run.decode.accept()
        run.decode.push(*events)
        await _settle()
        if run.exchange.failure is None:  # (an event that is wrong on its face fails at once: prefill is cancelled)
            await run.prefill_answers()
        relayed = run.relayed()
        run.decode.push(END)
        await run.finished()
        relayed += run.relayed()
        assert not any(isinstance(e, (Done, bytes)) for e in relayed), why  # not a byte, and no end of a 200
        assert isinstance(relayed[-1], Failure) and relayed[-1].error.status == 502, why
        assert run.exchange.outcome in ("decode_failed", "prompt_token_mismatch"), why
    _run(scenario)


def test_a_prefill_answer_of_an_unforeseen_shape_fails_the_request_instead_of_hanging_it() -> None:
    async def scenario() -> None:
        run = Run()
        await run.start()
        await run.first_token()
        run.prefill.accept()
        run.prefill.push(b'{"choices": 5, "meta_info": {"prompt_tokens": 10}}', END)
        await run.finished()
        assert [type(e) for e in run.relayed()] == [Failure]
    _run(scenario)


def test_decode_stops_reading_while_a_slow_client_has_a_megabyte_waiting() -> None:
    async def scenario() -> None:
        run = Run()
        await _reach(run, "mid_stream")
        big = orjson.dumps({"text": "x" * 100_000, "meta_info": {"prompt_tokens": COUNT}})
        run.decode.push(*([big] * 40))
        await asyncio.sleep(0.05)
        held = run.exchange.events.held_bytes
        assert 1 << 20 < held < 2 * (1 << 20)  # it stopped just past the high-water mark
        assert run.decode._items.qsize() > 20  # the rest is still with the engine, unread
        drained = run.relayed()
        await asyncio.sleep(0.05)
        assert len(drained) > 10 and run.decode._items.qsize() < 20  # reading resumed once the client caught up
        run.decode.push(b"[DONE]", END)
        run.exchange.disconnect()
        await run.finished()
    _run(scenario)


# ── what counts against a worker's circuit breaker ───────────────────────────────────────────────────────────
def test_a_client_that_stops_reading_is_not_an_idle_decode() -> None:
    """Backpressure stops reading decode; its silence meanwhile is the client's, not an engine failure."""
    async def scenario() -> None:
        run = Run()
        await run.start()
        await run.prefill_answers()
        await run.first_token()
        big = _event(text="y" * 100_000)
        run.decode.push(*[big] * 15)  # 1.5 MB: past the relay's high-water mark, nobody reading
        await asyncio.sleep(3 * FAST.idle_s)
        assert run.exchange.failure is None
        assert run.exchange.pair.decode.breaker_state is BreakerState.CLOSED
        run.relayed()  # the client catches up
        await _settle()
        run.decode.push(b"[DONE]", END)
        await run.finished()
        assert run.exchange.failure is None and isinstance(run.relayed()[-1], Done)
        assert run.exchange.pair.decode._breaker._failures == 0
    _run(scenario)


@pytest.mark.parametrize(("detail", "blamed"), [
    ("Could not fetch prefill parallel info from bootstrap_addr", False),  # the prefill's side, or the transfer
    ("CUDA error: an illegal memory access was encountered", True),
])
def test_a_decode_failure_before_prefill_delivered_is_blamed_only_when_it_is_the_decodes_own(
        detail: str, blamed: bool) -> None:
    async def scenario() -> None:
        run = Run()
        strict = BreakerSpec(failure_threshold=1)
        for worker in (run.exchange.pair.prefill, run.exchange.pair.decode):
            worker.reconfigure(breaker=strict, max_inflight=None)
        await run.start()
        run.decode.reject(EngineRejected("decode", f"decode answered 500: {detail}", status=500, detail=detail))
        await run.finished()
        decode, prefill = run.exchange.pair.decode, run.exchange.pair.prefill
        assert (decode.breaker_state is BreakerState.OPEN) is blamed
        assert prefill.breaker_state is BreakerState.CLOSED
    _run(scenario)


def test_with_logprobs_even_immediate_release_waits_for_the_prefills_prompt_logprobs() -> None:
    async def scenario() -> None:
        run = Run(release="immediate", merge_logprobs=True)
        await run.start()
        run.decode.accept()
        run.decode.push(orjson.dumps({"text": "x", "meta_info": {"prompt_tokens": COUNT, "input_token_logprobs": [],
                                                                 "output_token_logprobs": [[-0.1, 7, None]]}}))
        await _settle()
        assert run.relayed() == []  # the prompt's logprobs are not known yet
        run.prefill.accept()
        run.prefill.push(orjson.dumps({"text": "", "meta_info": {"prompt_tokens": COUNT,
                                                                 "input_token_logprobs": [[None, 1, None]]}}), END)
        await _settle()
        (event,) = run.relayed()
        assert orjson.loads(event)["meta_info"]["input_token_logprobs"] == [[None, 1, None]]
    _run(scenario)


@pytest.mark.parametrize(("cached", "flagged"), [(0, True), (COUNT, False)])
def test_a_fast_first_token_is_judged_by_the_tokens_prefill_did_not_have_cached(cached: int, flagged: bool) -> None:
    """A prompt served from the radix cache prefills in milliseconds: only the uncached tokens bound the time."""
    async def scenario() -> None:
        rule = TTFTPlausibility(max_prefill_tokens_per_s=1.0, min_prompt_tokens=1, strict=True)  # 10 tokens ≥ 10 s
        run = Run(plausibility=rule)
        await run.start()
        await run.first_token()
        run.prefill.accept()
        run.prefill.push(orjson.dumps({"text": "", "meta_info": {"prompt_tokens": COUNT, "cached_tokens": cached}}),
                         END)
        await _settle()
        run.decode.push(b"[DONE]", END)
        await run.finished()
        events = run.relayed()
        assert run.exchange.implausible_ttft is flagged
        if flagged:
            assert [type(e) for e in events] == [Failure] and events[0].error.code == "implausible_ttft"
        else:
            assert isinstance(events[-1], Done)
    _run(scenario)
