"""The engine client over real sockets: keep-alive reuse, bodies in every framing, error mapping at its edge, and
the promise behind restart safety — a new connection carries a generate request only after the engine on it has
shown the identity the KV-pool gate verified."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable

import orjson
import pytest

from routing.engines.client import EngineClient
from routing.engines.errors import (
    EngineAnswerTooLarge,
    EngineBroken,
    EngineChanged,
    EngineError,
    EngineRejected,
    EngineTimeout,
    EngineUnreachable,
)
from routing.engines.identity import EngineIdentity, parse_identity
from routing.workers import Worker, WorkerSpec

SERVER_INFO = {"max_total_num_tokens": 4096, "max_req_input_len": 4089, "page_size": 1, "version": "0.5.23",
               "disaggregation_mode": "decode", "served_model_name": "glm-5", "tokenizer_path": "/t",
               "context_length": 8192}

Handler = Callable[[str, bytes], Awaitable[bytes]]


class Engine:
    """A scripted HTTP/1.1 server: `/server_info` answers `info`; generate paths answer with `reply`."""

    def __init__(self, reply: bytes, *, hang_up: bool = False) -> None:
        self.info = dict(SERVER_INFO)
        self.reply = reply
        self.hang_up = hang_up
        self.connections = 0
        self.requests: list[tuple[int, str]] = []  # (connection number, path)
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                request_line, *headers = head.decode().split("\r\n")
                path = request_line.split()[1]
                length = next((int(h.split(":")[1]) for h in headers if h.lower().startswith("content-length")), 0)
                await reader.readexactly(length)
                self.requests.append((number, path))
                if path == "/server_info":
                    body = orjson.dumps(self.info)
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                else:
                    writer.write(self.reply)
                await writer.drain()
                if self.hang_up and path != "/server_info":
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        assert self.server is not None
        self.server.close()


def _worker(url: str) -> Worker:
    worker = Worker(WorkerSpec(url, "decode"))
    worker.accept(parse_identity(SERVER_INFO))
    return worker


def _client() -> EngineClient:
    return EngineClient(connect_timeout_s=1, verify_timeout_s=1, abort_timeout_s=1)


def _run(coroutine: Awaitable[None]) -> None:
    asyncio.run(coroutine)  # type: ignore[arg-type]


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
CHUNKED = STREAM_HEAD + _chunk(b'data: {"a":1}\n\n') + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


def test_events_stream_over_chunked_encoding_and_the_connection_is_reused() -> None:
    async def scenario() -> None:
        engine = Engine(CHUNKED)
        worker, client = _worker(await engine.start()), _client()
        for _ in range(3):
            response = await client.generate(worker, "/generate", (b"{}",))
            assert [e async for e in response.events(1 << 20)] == [b'{"a":1}', b"[DONE]"]
        # One connection, verified once, then three requests on it.
        assert engine.requests == [(1, "/server_info"), (1, "/generate"), (1, "/generate"), (1, "/generate")]
        await client.close()
        engine.close()
    _run(scenario())


@pytest.mark.parametrize(("reply", "hang_up"), [
    (b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\n{\"ok\":true}", False),
    (b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n{\"ok\":true}", True)])
def test_whole_bodies_with_a_length_or_ended_by_close(reply: bytes, hang_up: bool) -> None:
    async def scenario() -> None:
        engine = Engine(reply, hang_up=hang_up)
        worker, client = _worker(await engine.start()), _client()
        response = await client.generate(worker, "/generate", (b"{}",))
        assert await response.body(1 << 20) == b'{"ok":true}'
        await client.close()
        engine.close()
    _run(scenario())


def test_an_engine_restarted_with_another_identity_gets_no_request() -> None:
    async def scenario() -> None:
        engine = Engine(CHUNKED)
        url = await engine.start()
        worker, client = _worker(url), _client()
        woken: list[Worker] = []
        worker.on_needs_verification(woken.append)
        engine.info["max_total_num_tokens"] = 2048  # "restarted with a smaller pool"
        engine.info["max_req_input_len"] = 2041
        with pytest.raises(EngineChanged):
            await client.generate(worker, "/generate", (b"{}",))
        assert [path for _, path in engine.requests] == ["/server_info"]  # the generate never went out
        assert worker.verified is None and not worker.usable and woken == [worker]
        await client.close()
        engine.close()
    _run(scenario())


def test_refused_connection_is_unreachable_and_takes_the_worker_out() -> None:
    async def scenario() -> None:
        engine = Engine(CHUNKED)
        url = await engine.start()
        engine.close()
        await asyncio.sleep(0.05)
        worker, client = _worker(url), _client()
        with pytest.raises(EngineUnreachable) as caught:
            await client.generate(worker, "/generate", (b"{}",))
        assert not worker.usable
        assert url in caught.value.message  # for the operator's log
        public = caught.value.public_message  # the socket's own words may name the address ("('127.0.0.1', 1)")
        assert "127.0.0.1" not in public and public == "the decode engine could not be reached"
        await client.close()
    _run(scenario())


def test_non_2xx_is_a_rejection_with_the_engines_message_and_length_rejections_are_recognised() -> None:
    async def scenario() -> None:
        message = b'{"error": {"message": "Input length (9000 tokens) exceeds the maximum allowed length"}}'
        engine = Engine(b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(message), message))
        worker, client = _worker(await engine.start()), _client()
        with pytest.raises(EngineRejected) as caught:
            await client.generate(worker, "/generate", (b"{}",))
        assert caught.value.status == 400 and caught.value.length_rejection
        assert "exceeds the maximum allowed length" in caught.value.message
        assert "exceeds the maximum allowed length" in caught.value.public_message  # says what to change
        await client.close()
        engine.close()
    _run(scenario())


@pytest.mark.parametrize("head", [b"500 Internal Server Error", b"404 Not Found"])
def test_an_answer_that_is_not_a_rejection_of_the_request_keeps_its_words_for_the_log_only(head: bytes) -> None:
    async def scenario() -> None:
        message = b'{"message": "KVPoll.Failed: bootstrap server 10.3.0.7:8998 unreachable"}'  # or a proxy's page
        engine = Engine(b"HTTP/1.1 %s\r\ncontent-length: %d\r\n\r\n%s" % (head, len(message), message))
        url = await engine.start()
        worker, client = _worker(url), _client()
        with pytest.raises(EngineRejected) as caught:
            await client.generate(worker, "/generate", (b"{}",))
        assert url in caught.value.message and "10.3.0.7" in caught.value.message
        public = caught.value.public_message
        assert url not in public and "10.3.0.7" not in public and public.endswith(head[:3].decode())
        await client.close()
        engine.close()
    _run(scenario())


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 200 OK\r\ncontent-length: 5000\r\n\r\n" + b"x" * 5000,           # refused by its declared length
    b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n" + b"x" * 5000,              # refused as it grows
    STREAM_HEAD + _chunk(b"x" * 3000) + _chunk(b"x" * 2000)])                       # chunked, still coming
def test_a_whole_body_over_its_cap_is_too_large_and_its_connection_is_not_kept(reply: bytes) -> None:
    async def scenario() -> None:
        engine = Engine(reply)
        worker, client = _worker(await engine.start()), _client()
        response = await client.generate(worker, "/generate", (b"{}",))
        with pytest.raises(EngineAnswerTooLarge) as caught:
            await response.body(4096)
        assert isinstance(caught.value, EngineBroken) and "4096" in caught.value.public_message
        response.close()
        engine.reply = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"
        assert await (await client.generate(worker, "/generate", (b"{}",))).body(4096) == b"{}"
        assert engine.connections == 2  # the cut-off answer's connection was closed, a new one verified
        await client.close()
        engine.close()
    _run(scenario())


def test_an_event_over_its_cap_is_too_large() -> None:
    async def scenario() -> None:
        engine = Engine(STREAM_HEAD + _chunk(b'data: {"a":1}\n\n') + _chunk(b"data: " + b"x" * 3000)
                        + _chunk(b"x" * 3000) + b"0\r\n\r\n")
        worker, client = _worker(await engine.start()), _client()
        response = await client.generate(worker, "/generate", (b"{}",))
        events = response.events(4096)
        assert await anext(events) == b'{"a":1}'
        with pytest.raises(EngineAnswerTooLarge):
            await anext(events)
        response.close()
        await client.close()
        engine.close()
    _run(scenario())


def test_a_stream_cut_short_is_broken_not_finished() -> None:
    async def scenario() -> None:
        engine = Engine(STREAM_HEAD + _chunk(b'data: {"a":1}\n\n'), hang_up=True)
        worker, client = _worker(await engine.start()), _client()
        response = await client.generate(worker, "/generate", (b"{}",))
        events = response.events(1 << 20)
        assert await anext(events) == b'{"a":1}'
        with pytest.raises(EngineBroken):
            await anext(events)
        engine.close()
        await client.close()
    _run(scenario())


def test_identity_equality_is_what_the_gate_judges() -> None:
    assert parse_identity(SERVER_INFO) == EngineIdentity(4096, 4089, 1, "0.5.23", "decode", "glm-5", "/t", 8192)


def test_connect_s_bounds_a_connection_that_is_never_accepted() -> None:
    async def scenario() -> None:
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        fillers = [socket.socket() for _ in range(3)]  # fill the accept queue: further SYNs go unanswered
        for filler in fillers:
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(server.getsockname())
        await asyncio.sleep(0.05)
        worker = _worker(f"http://127.0.0.1:{server.getsockname()[1]}")
        client = EngineClient(connect_timeout_s=0.3, verify_timeout_s=1, abort_timeout_s=1)
        started = time.monotonic()
        with pytest.raises(EngineUnreachable):
            await client.connect(worker)
        assert 0.25 < time.monotonic() - started < 2
        await client.close()
        for sock in (server, *fillers):
            sock.close()
    _run(scenario())


@pytest.mark.parametrize("call", ["abort", "telemetry"])
def test_abort_s_and_telemetry_timeouts_bound_an_engine_that_never_answers(call: str) -> None:
    async def scenario() -> None:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(65536)
            await asyncio.sleep(30)

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = EngineClient(connect_timeout_s=1, verify_timeout_s=1, abort_timeout_s=0.3)
        started = time.monotonic()
        if call == "abort":
            assert await client.abort(url, "kvg-x") is False
        else:
            with pytest.raises(EngineTimeout):
                await client.get(url, "/server_info", timeout_s=0.3)
        assert 0.25 < time.monotonic() - started < 2
        await client.close()
        server.close()
    _run(scenario())


@pytest.mark.parametrize("head", [
    b"HTTP/1.1 200 OK\r\n" + b"x-pad: " + b"y" * (1 << 20) + b"\r\n\r\n",  # one header that never ends in time
    b"HTTP/1.1 200 OK\r\n" + b"".join(b"x-h%d: v\r\n" % i for i in range(500)) + b"\r\n",  # too many headers
])
def test_an_engine_response_head_over_its_cap_fails_before_it_is_buffered_whole(head: bytes) -> None:
    async def scenario() -> None:
        engine = Engine(head)
        worker, client = _worker(await engine.start()), _client()
        with pytest.raises(EngineError) as caught:
            await client.generate(worker, "/generate", (b"{}",))
        assert "response headers" in str(caught.value) or "more than 100" in str(caught.value)
        await client.close()
        engine.close()
    _run(scenario())


def test_a_server_info_over_its_cap_fails_the_identity_check() -> None:
    async def scenario() -> None:
        engine = Engine(CHUNKED)
        engine.info["padding"] = "x" * (17 << 20)  # valid JSON, over the 16 MiB telemetry cap
        worker, client = _worker(await engine.start()), _client()
        with pytest.raises(EngineError):
            await client.generate(worker, "/generate", (b"{}",))
        assert [path for _, path in engine.requests] == ["/server_info"]  # nothing was sent
        await client.close()
        engine.close()
    _run(scenario())


@pytest.mark.parametrize("reply", [
    STREAM_HEAD + _chunk(b'data: {"a":1}\n\n') + b"0\r\nx-trailer: " + b"t" * (4 << 20),  # an endless trailer
    STREAM_HEAD + b"".join(_chunk(b"d") for _ in range(200_000)),  # framing far beyond the body it carries
])
def test_endless_trailers_and_tiny_chunks_fail_before_they_grow_the_gateway(reply: bytes) -> None:
    async def scenario() -> None:
        engine = Engine(reply)
        worker, client = _worker(await engine.start()), _client()
        response = await client.generate(worker, "/generate", (b"{}",))
        with pytest.raises(EngineError) as caught:
            async for _ in response.events(1 << 20):
                pass
        assert "trailers" in str(caught.value) or "framing" in str(caught.value)
        response.close()
        await client.close()
        engine.close()
    _run(scenario())
