"""Generation endpoints: `/generate` (native) and the OpenAI `/v1/chat/completions` and `/v1/completions`.

Parses SGLang's request shapes, drives the Engine, applies injected faults and client-disconnect semantics, and
writes SGLang's response, stream and error shapes.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from typing import Any

import orjson

from .engine import Engine, Gen
from .errors import HTTPError
from .faults import Fault
from .formats import BAD_REQUEST, Format, NativeFormat, PromptSpec, StreamState, openai_error, sse
from .httpcore import Request
from .openai_formats import ChatFormat, CompletionFormat
from .prefix_cache import namespace
from .reqlog import ABORTED, CLIENT_DISCONNECTED, ERROR, FINISHED, ReqRecord
from .tokenizer import StreamDetokenizer

_DONE = b"data: [DONE]\n\n"


class GenerationAPI:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cfg = engine.cfg
        self._pieces: dict[int, str] = {}
        dialect = engine.cfg.dialect
        self._native = NativeFormat()
        self._chat = ChatFormat(dialect, engine.cfg.context_length, engine.tok.content_format,
                                engine.cfg.default_chat_template_kwargs)
        self._completion = CompletionFormat(dialect)
        self._chat.cache_report = self._completion.cache_report = engine.cfg.enable_cache_report

    async def generate(self, req: Request) -> None:
        await self._handle(req, self._native)

    async def chat(self, req: Request) -> None:
        await self._handle(req, self._chat)

    async def completions(self, req: Request) -> None:
        await self._handle(req, self._completion)

    # request flow
    async def _handle(self, req: Request, fmt: Format) -> None:
        eng = self.engine
        try:
            # validate_json_request: the media type must be exactly application/json on the OpenAI routes
            if fmt is not self._native and req.headers.get("content-type", "").lower().split(";", 1)[0] \
                    != "application/json":
                raise ValueError("Unsupported Media Type: Only 'application/json' is allowed")
            body = orjson.loads(req.body)
            if not isinstance(body, dict):
                raise ValueError("request body must be a JSON object")
            spec = fmt.parse(body)
        except HTTPError as e:
            req.respond(e.status, fmt.error_body(e.status, e.message, e.err_type))
            return
        except (ValueError, TypeError) as e:  # orjson.JSONDecodeError is a ValueError
            req.respond(400, fmt.error_body(400, str(e), BAD_REQUEST))
            return
        rid = body.get("rid")
        rec = ReqRecord(rid if isinstance(rid, str) and rid else os.urandom(16).hex(), self.cfg.role, req.path,
                        spec.stream)
        room, host, port = body.get("bootstrap_room"), body.get("bootstrap_host"), body.get("bootstrap_port")
        rec.bootstrap_room, rec.bootstrap_host, rec.bootstrap_port = room, host, port
        rec.traceparent = req.headers.get("traceparent")
        rec.request_id = req.headers.get("x-request-id")
        rec.extra_key = namespace(body)
        eng.log.add(rec)
        fault = eng.faults.take("generation", req.path, rec.rid)
        extra_first_delay = 0.0
        prompt_offset = 0
        if fault is not None:
            rec.fault = fault.action
            if fault.action == "slow_first_token":
                extra_first_delay = fault.delay_ms / 1000
            elif fault.action == "miscount":
                prompt_offset = fault.offset
            elif (fault.action == "bad_chunk" and spec.stream) or fault.action == "abort_object":
                pass  # run normally; the corrupt event goes out just before the end, the abort once tokenized
            elif fault.action != "drop" or not spec.stream or fault.after_chunks <= 0:
                await self._apply_fault(req, fmt, rec, fault, spec.stream)
                return
        try:
            ids = await fmt.tokenize(eng.tok, spec)
        except HTTPError as e:
            rec.finish(ERROR, e.status, e.message)
            req.respond(e.status, fmt.error_body(e.status, e.message, e.err_type))
            return
        rec.prompt_tokens = len(ids)
        if fault is not None and fault.action == "abort_object":
            self._abort_object(req, rec, fault, spec.stream, len(ids))
            return
        gen = Gen(rec, ids, spec.max_new, fmt.default_max_new, host, port, room if isinstance(room, int) else None)
        gen.prompt_offset = prompt_offset
        gen.hide_stub = self.cfg.hide_stub
        gen.task = asyncio.current_task()  # type: ignore[assignment]
        eng.metrics.num_requests.inc()
        if spec.stream:
            await self._stream(req, fmt, spec, gen, fault, extra_first_delay)
        else:
            await self._unary(req, fmt, spec, gen, extra_first_delay)

    def _watch_disconnect(self, req: Request, gen: Gen, stream: bool) -> None:
        """Abort like SGLang when the client leaves: non-stream at the next 4 s `is_disconnected()` poll, stream by
        the background abort task that runs `stream_abort_delay_s` after the response ends."""
        eng, cfg = self.engine, self.cfg

        def lost() -> None:
            rec = gen.rec
            rec.connection_closed = req.conn.closed_at
            if rec.outcome is not None:
                return
            if stream:
                delay = cfg.stream_abort_delay_s
            else:
                poll = cfg.disconnect_poll_s
                elapsed = time.time() - rec.arrival
                delay = math.ceil(elapsed / poll) * poll - elapsed if poll > 0 else 0.0
            asyncio.get_running_loop().call_later(max(delay, 0.0), eng.abort, gen, CLIENT_DISCONNECTED)

        req.conn.on_lost = lost
        if req.conn.closed_at is not None:  # the client left while the request was being parsed
            lost()

    async def _unary(self, req: Request, fmt: Format, spec: PromptSpec, gen: Gen, extra_first_delay: float) -> None:
        eng, rec = self.engine, gen.rec
        self._watch_disconnect(req, gen, stream=False)
        try:
            eng.admit(gen)
            await eng.run(gen)
            n = len(gen.output)
            if self.cfg.role == "decode":
                delay = (self.cfg.first_token_delay_ms + max(n - 1, 0) * self.cfg.token_delay_ms) / 1000
                if delay + extra_first_delay > 0:
                    await asyncio.sleep(delay + extra_first_delay)
            text = eng.tok.decode(gen.output)
            if spec.echo:  # serving_completions: the prompt's text leads the answer
                text = (spec.text if spec.text is not None else eng.tok.decode(spec.input_ids or [])) + text
            self._account(gen, rec.arrival)
            rec.completion_tokens = n
            rec.finish(FINISHED, 200)
            req.respond(200, fmt.ok_body(gen, text, self._finish_reason(gen), spec, self.cfg))
        except HTTPError as e:
            rec.finish(ERROR, e.status, e.message)
            req.respond(e.status, fmt.error_body(e.status, e.message))
        except asyncio.CancelledError:
            if not self._took_abort(gen):
                raise
            if gen.abort_reason == CLIENT_DISCONNECTED:
                rec.finish(CLIENT_DISCONNECTED, None)
            else:
                rec.finish(ABORTED, 200)
                req.respond(200, fmt.ok_body(gen, "", _ABORT_FINISH, spec, self.cfg))
        finally:
            req.conn.on_lost = None
            eng.release(gen)

    async def _stream(self, req: Request, fmt: Format, spec: PromptSpec, gen: Gen, fault: Fault | None,
                      extra_first_delay: float) -> None:
        """Headers go out at once (StreamingResponse); errors after that are chunks inside an HTTP 200."""
        eng, rec, cfg = self.engine, gen.rec, self.cfg
        req.start_stream()
        self._watch_disconnect(req, gen, stream=True)
        drop_after = fault.after_chunks if fault is not None and fault.action == "drop" else None
        sent = 0
        try:
            eng.admit(gen)
            await eng.run(gen)
            detok = StreamDetokenizer(eng.tok, self._pieces)
            state = StreamState(gen, spec)
            if spec.echo:
                state.echo_text = spec.text if spec.text is not None else eng.tok.decode(spec.input_ids or [])
            batch: list[bytes] = fmt.stream_head(state)
            first_delay = (cfg.first_token_delay_ms / 1000 if cfg.role == "decode" else 0.0) + extra_first_delay
            token_delay = cfg.token_delay_ms / 1000 if cfg.role == "decode" else 0.0
            n = len(gen.output)
            for i, tok in enumerate(gen.output):
                delay = first_delay if i == 0 else token_delay
                if delay > 0:  # zero delays: coalesce the chunks into one write, as a batched detokenizer would
                    sent = await self._flush(req, batch, sent, drop_after, gen)
                    await asyncio.sleep(delay)
                last = i == n - 1
                if i == 0:
                    rec.first_token = time.time()
                batch.append(fmt.stream_token(state, i, detok.push(tok), self._finish_reason(gen) if last else None))
            if n == 0:
                batch.append(fmt.stream_token(state, -1, "", self._finish_reason(gen)))
            self._account(gen, rec.arrival)
            rec.completion_tokens = n
            if fault is not None and fault.action == "bad_chunk":
                batch.append(b'data: {"choices": [{"index": 0, "delta"\n\n')
            batch.extend(fmt.stream_tail(state))
            batch.append(_DONE)
            sent = await self._flush(req, batch, sent, drop_after, gen)
            rec.finish(FINISHED, 200)
            req.end_stream()
        except HTTPError as e:
            rec.finish(ERROR, e.status, e.message)
            if req.send_chunk(fmt.stream_error(e.status, e.message) + _DONE):
                req.end_stream()
        except asyncio.CancelledError:
            if not self._took_abort(gen):
                raise
            if gen.abort_reason == CLIENT_DISCONNECTED:
                rec.finish(CLIENT_DISCONNECTED, None)
            else:
                rec.finish(ABORTED, 200)
                state = StreamState(gen, spec)
                if req.send_chunk(fmt.stream_token(state, -1, "", _ABORT_FINISH) + _DONE):
                    req.end_stream()
        finally:
            req.conn.on_lost = None
            eng.release(gen)

    async def _flush(self, req: Request, batch: list[bytes], sent: int, drop_after: int | None, gen: Gen) -> int:
        if not batch:
            return sent
        if drop_after is not None and sent + len(batch) >= drop_after:
            for chunk in batch[:drop_after - sent]:
                req.send_chunk(chunk)
            gen.rec.finish(ERROR, 200, "connection dropped by fault")
            req.conn.abort()
            raise asyncio.CancelledError  # handled as a disconnect below
        ok = req.send_chunk(b"".join(batch))
        sent += len(batch)
        batch.clear()
        if not ok:
            await asyncio.Future()  # the write failed: hold the pages until the scheduled abort cancels us
        return sent

    def _took_abort(self, gen: Gen) -> bool:
        """A cancellation we caused (abort or fault) rather than a server shutdown."""
        task = asyncio.current_task()
        if gen.abort_reason is not None or gen.rec.outcome is not None:
            if task is not None and task.cancelling():
                task.uncancel()
            if gen.abort_reason is None:
                gen.abort_reason = CLIENT_DISCONNECTED
            return True
        return False

    def _abort_object(self, req: Request, rec: ReqRecord, fault: Fault, stream: bool, prompt_tokens: int) -> None:
        """An abort as FINISH_ABORT's object in the finish reason, with the prompt counted right: nothing else in the
        answer gives it away."""
        rec.finish(ABORTED, 200, fault.message)
        finish = {"type": "abort", "message": fault.message, "status_code": fault.status}
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}
        answer: dict[str, Any]
        if req.path == "/generate":
            answer = {"text": "", "output_ids": [], "meta_info": {"id": rec.rid, "finish_reason": finish,
                                                                  "prompt_tokens": prompt_tokens,
                                                                  "completion_tokens": 0}}
        else:
            key = "delta" if stream else ("message" if "chat" in req.path else "text")
            value: Any = {"delta": {}, "message": {"role": "assistant", "content": ""}, "text": ""}[key]
            answer = {"id": rec.rid, "object": "chat.completion", "model": self.cfg.model, "usage": usage,
                      "choices": [{"index": 0, key: value, "finish_reason": finish}]}
        if stream:
            req.start_stream()
            if req.send_chunk(sse(answer) + _DONE):
                req.end_stream()
        else:
            req.respond(200, orjson.dumps(answer))

    def _finish_reason(self, gen: Gen) -> dict[str, Any]:
        if self.cfg.role == "prefill":
            return {"type": "length", "length": 0}
        return {"type": "length", "length": len(gen.output)}

    def _account(self, gen: Gen, arrival: float) -> None:
        m, now = self.engine.metrics, time.time()
        m.prompt_tokens.inc(len(gen.input_ids))
        m.generation_tokens.inc(len(gen.output))
        m.ttft.observe(now - arrival)
        m.e2e.observe(now - arrival)
        self.engine.note_generated(len(gen.output))

    async def _apply_fault(self, req: Request, fmt: Format, rec: ReqRecord, fault: Fault, stream: bool) -> None:
        if fault.delay_ms > 0 and fault.action != "hang":
            await asyncio.sleep(fault.delay_ms / 1000)
        if fault.action == "fail":
            rec.finish(ERROR, fault.status, fault.message)
            req.respond(fault.status, fmt.error_body(fault.status, fault.message))
        elif fault.action == "error_body":  # SGLang's OpenAI error object under any status, or as a stream event
            error = openai_error(fault.code, fault.message, fault.error_type)
            if stream:
                rec.finish(ERROR, 200, fault.message)
                req.start_stream()
                if req.send_chunk(sse(error) + _DONE):
                    req.end_stream()
            else:
                rec.finish(ERROR, fault.status, fault.message)
                req.respond(fault.status, orjson.dumps(error))
        elif fault.action == "bad_chunk":  # not streaming: a whole answer that is cut off mid-object
            rec.finish(ERROR, 200, "corrupt answer by fault")
            req.respond(200, b'{"choices": [{"index": 0, "message"')
        elif fault.action == "drop":
            rec.finish(ERROR, None, "connection dropped by fault")
            req.conn.abort()
        elif fault.action == "huge":
            rec.finish(ERROR, 200, "huge answer by fault")
            await _write_huge(req, fault.size, stream)
        elif fault.action == "hang":
            await req.wait_closed()
            rec.connection_closed = req.conn.closed_at
            rec.finish(CLIENT_DISCONNECTED, None)


async def _write_huge(req: Request, size: int, stream: bool) -> None:
    """`size` bytes in 1 MiB chunks, written as the peer reads them (never more than 4 MiB buffered here): streamed,
    `data: {"text": "xxx…` with no blank line ever; else a JSON body sent chunked (no length to refuse it by)."""
    req.start_stream(content_type=b"text/event-stream" if stream else b"application/json")
    piece = b"x" * (1 << 20)
    head = b'data: {"text": "' if stream else b'{"text": "'
    sent = 0
    transport = req.conn.transport
    while sent < size:
        chunk = head + piece[:min(len(piece), size - sent) - len(head)] if sent == 0 else piece[:size - sent]
        if not req.send_chunk(chunk):
            return
        sent += len(chunk)
        while transport is not None and transport.get_write_buffer_size() > 4 << 20 and req.conn.closed_at is None:
            await asyncio.sleep(0.002)
    if not stream:
        req.send_chunk(b'"}')
    req.end_stream()


_ABORT_FINISH = {"type": "abort", "message": "Abort by /abort_request", "status_code": None, "err_type": None}
