"""One PD request, from dispatch to the last byte: the place where kvgate's promises live.

    DISPATCHED ─ both halves sent at once, same gateway-owned rid and bootstrap_room
      ├─ prefill: read to its end (it answers only after the KV transfer), then checked
      └─ decode:  streamed (even for non-streaming clients, to see the first token), relayed as it comes
    DONE       ─ decode sent [DONE] and prefill answered 2xx with a clean body
    CANCELLED  ─ any failure of either half: the other half is closed and sent /abort_request at once
    CLIENT GONE ─ the request keeps running until prefill has answered and decode has produced its first token
                  (so no KV transfer is cut mid-way), then decode is closed and sent /abort_request.

The exchange runs in tasks of its own, never in the client's handler, so a disconnect cannot cancel it; it is kept
alive by `InFlight` until both halves are closed and every abort has been sent.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from gateway.admission.admit import AdmittedRequest
from gateway.config import TimeoutsConfig
from gateway.engines import EngineClient, EngineError, error_message, is_length_rejection, iter_sse_data
from gateway.errors import GatewayError
from routing.pools import WorkerPair
from routing.workers import Worker

DONE = object()          # decode finished and prefill was verified
CLIENT_GONE = object()   # the client disconnected; the relay stops


class Failure:
    """The first failure of an exchange, as the client will see it."""

    __slots__ = ("error",)

    def __init__(self, error: GatewayError) -> None:
        self.error = error


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


class InFlight:
    """Owns every running exchange, so none is garbage-collected or forgotten at shutdown."""

    def __init__(self) -> None:
        self.exchanges: set[PDExchange] = set()

    async def drain(self, timeout_s: float) -> None:
        waiting = [exchange.closed for exchange in self.exchanges]
        if waiting:
            await asyncio.wait(waiting, timeout=timeout_s)
        for exchange in list(self.exchanges):
            exchange.fail(GatewayError(503, "gateway is shutting down"))


def map_engine_error(error: EngineError) -> GatewayError:
    """Engine failures → client statuses: 400 stays 400 (413 for a length rejection), 5xx and connection
    errors → 502, timeouts → 504. Never 200."""
    if error.timeout:
        return GatewayError(504, str(error), code=f"{error.role}_timeout")
    if error.length_rejection:
        return GatewayError(413, str(error), code="context_length_exceeded")
    if error.status == 400:
        return GatewayError(400, str(error), code=f"{error.role}_bad_request")
    if error.status == 429:
        return GatewayError(503, str(error), code=f"{error.role}_overloaded")
    return GatewayError(502, str(error), code=f"{error.role}_failed")


class PDExchange:
    """Both halves of one request. Created by the proxy, which then reads `events` (decode payloads)."""

    def __init__(self, engines: EngineClient, pair: WorkerPair, admitted: AdmittedRequest, *,
                 timeouts: TimeoutsConfig, in_flight: InFlight, rooms: RoomAllocator,
                 on_closed: Callable[[PDExchange], None] | None = None) -> None:
        self.engines = engines
        self.pair = pair
        self.admitted = admitted
        self.timeouts = timeouts
        self.rid = new_rid()
        self.room = rooms.acquire()
        self.events: asyncio.Queue[Any] = asyncio.Queue()
        self.failure: Failure | None = None
        self.client_gone = False
        self.prefill_ok: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.started_at = time.monotonic()
        self.first_token_at: float | None = None
        self.decode_finished = False
        self._rooms = rooms
        self._in_flight = in_flight
        self._on_closed = on_closed
        self._tasks: set[asyncio.Task[None]] = set()
        self._prefill_task: asyncio.Task[None] | None = None
        self._decode_task: asyncio.Task[None] | None = None
        self._total_timer: asyncio.TimerHandle | None = None

    # ── dispatch ────────────────────────────────────────────────────────────────────────────────────────────
    def start(self) -> None:
        body = self.admitted.engine_body()
        body["rid"] = self.rid
        body["bootstrap_room"] = self.room
        body["bootstrap_host"] = self.pair.prefill.bootstrap_host
        body["bootstrap_port"] = self.pair.prefill.bootstrap_port
        prefill_body = orjson.dumps({**body, "stream": False})
        body["stream"] = True
        if self.admitted.request.route != "/generate" and not self.admitted.request.stream:
            # A non-streaming client still gets usage; the decode stream only carries it on request.
            body["stream_options"] = {"include_usage": True}
        decode_body = orjson.dumps(body)
        self.pair.prefill.in_flight += 1
        self.pair.decode.in_flight += 1
        self._in_flight.exchanges.add(self)
        self._prefill_task = self._spawn(self._run_prefill(prefill_body))
        self._decode_task = self._spawn(self._run_decode(decode_body))
        self._total_timer = asyncio.get_running_loop().call_later(self.timeouts.total_s, self._total_timeout)

    def _spawn(self, coroutine: Any) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not self._tasks and not self.closed.done():
            self._close()

    def _close(self) -> None:
        if self._total_timer is not None:
            self._total_timer.cancel()
        self.pair.prefill.in_flight -= 1
        self.pair.decode.in_flight -= 1
        self._rooms.release(self.room)
        self._in_flight.exchanges.discard(self)
        self.closed.set_result(None)
        if self._on_closed is not None:
            self._on_closed(self)

    # ── outcomes ────────────────────────────────────────────────────────────────────────────────────────────
    def fail(self, error: GatewayError) -> None:
        """The first failure wins: both halves still running are cancelled (each aborts itself on the way out)."""
        if self.failure is not None:
            return
        self.failure = Failure(error)
        self.events.put_nowait(self.failure)
        if not self.prefill_ok.done():
            self.prefill_ok.set_result(False)
        for task in (self._prefill_task, self._decode_task):
            if task is not None and not task.done():
                task.cancel()

    def _fail_engine(self, error: EngineError) -> None:
        if error.unreachable:
            # A refused connection may be a restart: keep the worker out of rotation until the monitor has read
            # its telemetry again and it has passed the KV-pool gate.
            worker = self.pair.prefill if error.role == "prefill" else self.pair.decode
            worker.admitted = False
            worker.gate_reason = "connection failed; awaiting re-verification"
        self.fail(map_engine_error(error))

    def _total_timeout(self) -> None:
        self.fail(GatewayError(504, f"request exceeded its total time limit of {self.timeouts.total_s:g}s",
                               code="total_timeout"))

    def disconnect(self) -> None:
        """The client went away: hold prefill to its answer and decode to its first token, then stop."""
        if self.client_gone:
            return
        self.client_gone = True
        self.events.put_nowait(CLIENT_GONE)
        if self.first_token_at is not None and self._decode_task is not None and not self._decode_task.done():
            self._decode_task.cancel()

    # ── prefill half ────────────────────────────────────────────────────────────────────────────────────────
    async def _run_prefill(self, body: bytes) -> None:
        worker = self.pair.prefill
        ok = False
        try:
            async with asyncio.timeout(self.timeouts.prefill_s):
                response = await self.engines.post("prefill", worker.url + self.admitted.request.route, body)
                try:
                    payload = await response.read()
                finally:
                    response.release()
            _check_prefill_body(payload)
            ok = True
            if not self.prefill_ok.done():
                self.prefill_ok.set_result(True)
        except TimeoutError:
            self._fail_engine(EngineError("prefill", f"prefill did not answer within {self.timeouts.prefill_s:g}s",
                                          timeout=True))
        except EngineError as error:
            self._fail_engine(error)
        except (aiohttp.ClientError, OSError) as error:
            self._fail_engine(EngineError("prefill", f"prefill connection failed: {error!r}"))
        finally:
            if not ok:
                self._spawn(self._abort(worker))

    # ── decode half ─────────────────────────────────────────────────────────────────────────────────────────
    async def _run_decode(self, body: bytes) -> None:
        worker = self.pair.decode
        response: aiohttp.ClientResponse | None = None
        watchdog: IdleWatchdog | None = None
        try:
            async with asyncio.timeout(self.timeouts.first_token_s):
                response = await self.engines.post("decode", worker.url + self.admitted.request.route, body)
                events = iter_sse_data(response)
                first = await anext(events, None)
            if first is None or first == b"[DONE]":
                raise EngineError("decode", "decode stream ended before its first token")
            _check_decode_event(first)
            self.first_token_at = time.monotonic()
            self.events.put_nowait(first)
            if self.client_gone:
                return
            watchdog = IdleWatchdog(self.timeouts.idle_s, asyncio.current_task())
            async for data in events:
                watchdog.touch()
                if data == b"[DONE]":
                    self.decode_finished = True
                    continue
                if b'"error"' in data or b'"abort"' in data:
                    _check_decode_event(data)
                self.events.put_nowait(data)
            if not self.decode_finished:
                raise EngineError("decode", "decode stream ended without [DONE]")
            self.events.put_nowait(DONE)
        except TimeoutError:
            self._fail_engine(EngineError("decode", f"decode produced no first token within "
                                          f"{self.timeouts.first_token_s:g}s", timeout=True))
        except EngineError as error:
            self._fail_engine(error)
        except (aiohttp.ClientError, OSError) as error:
            self._fail_engine(EngineError("decode", f"decode stream broke: {error!r}"))
        except asyncio.CancelledError:
            if watchdog is not None and watchdog.fired and self.failure is None:
                self._fail_engine(EngineError("decode", f"decode sent nothing for {self.timeouts.idle_s:g}s",
                                              timeout=True))
            elif not self.client_gone and self.failure is None:
                raise
        finally:
            if watchdog is not None:
                watchdog.stop()
            if response is not None:
                if self.decode_finished:
                    response.release()
                else:
                    response.close()
            if not self.decode_finished:
                self._spawn(self._abort(worker))

    async def _abort(self, worker: Worker) -> None:
        await self.engines.abort(worker.url, self.rid)


class IdleWatchdog:
    """Cancels a task after `idle_s` without `touch()`. One timer per idle period, re-armed lazily, because
    re-arming a timer on every chunk would cost more than the relay itself."""

    def __init__(self, idle_s: float, task: asyncio.Task[Any] | None) -> None:
        self._idle_s = idle_s
        self._task = task
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self._timer: asyncio.TimerHandle | None = self._loop.call_at(self._last + idle_s, self._check)
        self.fired = False

    def touch(self) -> None:
        self._last = self._loop.time()

    def _check(self) -> None:
        deadline = self._last + self._idle_s
        if self._loop.time() < deadline:
            self._timer = self._loop.call_at(deadline, self._check)
            return
        self._timer = None
        self.fired = True
        if self._task is not None:
            self._task.cancel()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def _check_prefill_body(payload: bytes) -> None:
    """A 200 prefill can still carry an error or an abort (SGLang 0.5.8 answers 200 for a prompt it swapped)."""
    try:
        parsed = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise EngineError("prefill", "prefill answered 2xx with a body that is not JSON") from exc
    _raise_if_failed("prefill", parsed)


def _check_decode_event(data: bytes) -> None:
    try:
        parsed = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise EngineError("decode", f"decode sent an event that is not JSON: {data[:200]!r}") from exc
    _raise_if_failed("decode", parsed)


def _raise_if_failed(role: str, parsed: Any) -> None:
    if not isinstance(parsed, dict):
        raise EngineError(role, f"{role} answered with unexpected JSON")
    if "error" in parsed:
        error = parsed["error"]
        message = error_message(orjson.dumps(parsed))
        code = error.get("code") if isinstance(error, dict) else None
        status = code if isinstance(code, int) else 500
        raise EngineError(role, f"{role} reported an error: {message}", status=status,
                          length_rejection=is_length_rejection(message))
    finish = (parsed.get("meta_info") or {}).get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        message = str(finish.get("message") or "request aborted")
        status = finish.get("status_code") if isinstance(finish.get("status_code"), int) else 500
        raise EngineError(role, f"{role} aborted the request: {message}", status=status,
                          length_rejection=is_length_rejection(message))
    for choice in parsed.get("choices") or ():
        if isinstance(choice, dict) and choice.get("finish_reason") == "abort":
            raise EngineError(role, f"{role} aborted the request", status=500)
