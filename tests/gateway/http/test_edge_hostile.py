"""A hostile client against the generate routes served straight from the HTTP protocol (gateway.http.edge), over raw
sockets: request smuggling and desync, answers given before the body was read, response framing on every path,
clients that leave at each phase or never read, and failures inside the endpoint."""

from __future__ import annotations

import hashlib
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.http.relay import ClientResponse
from gateway.pd import events as events_module
from gateway.pd import exchange as exchange_module
from loadtests.engine.harness import EnginePair, start_pair
from tests.engine_records import generation_records, wait_for
from tests.gateway.http.test_edge import _Answers
from tests.gateway_harness import RunningGateway, model_entry, running_gateway, write_config

KEY = b"sk-hostile"
GENERATE = b'{"text": "hello there", "sampling_params": {"max_new_tokens": 4}}'
pytestmark = pytest.mark.long_running(seconds=45)  # the whole file: streams, timeouts, clients left to stall

LONG_STREAM = (b'{"model": "glm-5", "prompt": "go on", "max_tokens": 400, "ignore_eos": true, "stream": true}')


@pytest.fixture(scope="module")
def pair() -> Iterator[EnginePair]:
    with start_pair(prefill_pool=20000, decode_pool=20000, context_length=8192, model="glm-5", version="0.5.23",
                    bug=False, token_delay_ms=10) as started:
        yield started


@pytest.fixture(scope="module")
def gateway(pair: EnginePair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    tenants = [{"name": "hostile", "api_keys": ["sha256:" + hashlib.sha256(KEY).hexdigest()]}]
    config = write_config(tmp_path_factory.mktemp("hostile"), [model_entry("glm-5", [pair.prefill], [pair.decode])],
                          tenants=tenants, auth={"required": True}, timeouts={"client_body_s": 2.0})
    with running_gateway(config) as running:
        yield running


def _connect(gateway: RunningGateway) -> socket.socket:
    return socket.create_connection(("127.0.0.1", int(gateway.url.rsplit(":", 1)[1])), timeout=20)


def _post(path: bytes, body: bytes, *, key: bytes = KEY, extra: bytes = b"", length: bool = True) -> bytes:
    auth = b"authorization: Bearer %s\r\n" % key if key else b""
    cl = b"content-length: %d\r\n" % len(body) if length else b""
    return b"POST %s HTTP/1.1\r\nhost: kvgate\r\ncontent-type: application/json\r\n%s%s%s\r\n%s" % (
        path, auth, extra, cl, body)


def _all_answers(sock: socket.socket, *, settle_s: float = 3.0) -> tuple[list[dict[str, Any]], bool]:
    """Every answer until the server closes or goes quiet for `settle_s`; whether it closed."""
    answers = _Answers(sock)
    sock.settimeout(settle_s)
    closed = False
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                closed = True
                break
            answers._parser.feed_data(data)
    except TimeoutError:
        pass
    except ConnectionResetError:
        closed = True
    return answers.done, closed  # type: ignore[return-value]


# ── smuggling and desync ────────────────────────────────────────────────────────────────────────────────────────────

def test_content_length_with_transfer_encoding_is_refused_and_closed(gateway: RunningGateway) -> None:
    smuggled = _post(b"/generate", GENERATE)
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(GENERATE), GENERATE)
    with _connect(gateway) as sock:
        sock.sendall(_post(b"/generate", chunked + smuggled, extra=b"transfer-encoding: chunked\r\n"))
        answers, closed = _all_answers(sock)
    assert [a["status"] for a in answers] == [400] and closed, answers


def test_two_content_lengths_are_refused_and_closed(gateway: RunningGateway) -> None:
    with _connect(gateway) as sock:
        sock.sendall(_post(b"/generate", GENERATE + _post(b"/generate", GENERATE),
                           extra=b"content-length: %d\r\n" % len(GENERATE)))
        answers, closed = _all_answers(sock)
    assert [a["status"] for a in answers] == [400] and closed, answers


@pytest.mark.parametrize("head", [b"POST /generate HTTP/1.1\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n{}",
                                  b"POST /generate HTTP/1.1\r\nhost: a b\x01\r\n\r\n", b"\x16\x03\x01\x00 not http\r\n\r\n"])
def test_a_request_the_parser_refuses_is_answered_with_a_request_id(gateway: RunningGateway, head: bytes) -> None:
    with _connect(gateway) as sock:
        sock.sendall(head)
        answers, closed = _all_answers(sock)
    assert [a["status"] for a in answers] == [400] and closed, answers
    assert len(answers[0]["headers"].get("x-request-id", "")) == 32, answers[0]["headers"]


def test_a_chunked_body_is_served_and_what_follows_it_is_the_next_request(gateway: RunningGateway) -> None:
    half = len(GENERATE) // 2
    chunked = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (half, GENERATE[:half], len(GENERATE) - half, GENERATE[half:])
    with _connect(gateway) as sock:
        sock.sendall(_post(b"/generate", chunked, extra=b"transfer-encoding: chunked\r\n", length=False)
                     + _post(b"/generate", GENERATE))
        answers, _ = _all_answers(sock)
    assert [a["status"] for a in answers] == [200, 200], answers


@pytest.mark.parametrize("key", [b"sk-wrong", b""])
def test_a_body_left_unread_by_an_early_refusal_is_never_taken_for_a_request(gateway: RunningGateway,
                                                                            key: bytes) -> None:
    """401 before the body is read: the body (here a whole request, smuggled) is skipped, the next one served."""
    smuggled = _post(b"/generate", GENERATE, key=KEY)
    with _connect(gateway) as sock:
        sock.sendall(_post(b"/generate", smuggled, key=key) + _post(b"/generate", GENERATE))
        answers, _ = _all_answers(sock)
    assert [a["status"] for a in answers] == [401, 200], answers[0]["body"]
    assert all("x-request-id" in a["headers"] for a in answers)


def test_an_early_refusal_of_a_slow_body_is_answered_at_once_and_the_body_skipped(gateway: RunningGateway) -> None:
    smuggled = _post(b"/generate", GENERATE, key=KEY)
    request = _post(b"/generate", smuggled, key=b"sk-wrong")
    head, body = request[: -len(smuggled)], smuggled
    with _connect(gateway) as sock:
        sock.sendall(head)
        answers = _Answers(sock)
        assert answers.read(1)[0]["status"] == 401
        for n in range(0, len(body), 7):
            sock.sendall(body[n:n + 7])
        sock.sendall(_post(b"/generate", GENERATE))
        rest, _ = _all_answers(sock)
    assert [a["status"] for a in rest] == [200], rest


def test_expect_100_continue_refused_before_the_body_does_not_eat_the_next_request(gateway: RunningGateway) -> None:
    """A client that asked to continue and got a final answer instead does not send that body (RFC 9110 10.1.1):
    the gateway must not then take the client's next request for it."""
    request = _post(b"/generate", GENERATE, key=b"sk-wrong", extra=b"expect: 100-continue\r\n")
    with _connect(gateway) as sock:
        sock.sendall(request[: -len(GENERATE)])
        answers = _Answers(sock)
        first = answers.read(1)[0]
        assert first["status"] == 401
        if first["headers"].get("connection") == "close":
            assert answers.closed_by_server()
            return
        sock.sendall(_post(b"/generate", GENERATE))  # the body was never sent: this is a new request
        rest, _ = _all_answers(sock, settle_s=5)
    assert [a["status"] for a in rest] == [200], rest


@pytest.mark.parametrize("request_id", [b"a" * 129, b"x y", b"\xff\xfe", b"ok\"<script>", b"id;set-cookie=1"])
def test_a_client_request_id_outside_the_pattern_is_replaced(gateway: RunningGateway, request_id: bytes) -> None:
    with _connect(gateway) as sock:
        sock.sendall(_post(b"/generate", GENERATE, extra=b"x-request-id: %s\r\n" % request_id))
        answers, _ = _all_answers(sock, settle_s=2)
    assert answers and answers[0]["status"] == 200
    assert answers[0]["headers"]["x-request-id"] != request_id.decode("latin-1")
    assert len(answers[0]["headers"]["x-request-id"]) == 32


# ── framing ─────────────────────────────────────────────────────────────────────────────────────────────────────────

def test_a_request_pipelined_behind_a_stream_is_answered_after_its_terminator(gateway: RunningGateway) -> None:
    short = LONG_STREAM.replace(b"400", b"20")
    with _connect(gateway) as sock:
        sock.sendall(_post(b"/v1/completions", short) + _post(b"/generate", GENERATE) + _post(b"/v1/completions",
                                                                                              short))
        answers, closed = _all_answers(sock, settle_s=2)
    assert [a["status"] for a in answers] == [200, 200, 200] and not closed
    assert answers[0]["body"].endswith(b"data: [DONE]\n\n") and answers[2]["body"].endswith(b"data: [DONE]\n\n")
    assert int(answers[1]["headers"]["content-length"]) == len(answers[1]["body"])


def test_connection_close_closes_after_the_answer_and_nothing_pipelined_runs(gateway: RunningGateway,
                                                                              pair: EnginePair) -> None:
    seen = len(generation_records(pair.decode))
    with _connect(gateway) as sock:
        sock.sendall(_post(b"/generate", GENERATE, extra=b"connection: close\r\n")
                     + _post(b"/generate", GENERATE.replace(b"hello", b"pipelined")))
        answers, closed = _all_answers(sock)
    assert [a["status"] for a in answers] == [200] and closed
    assert answers[0]["headers"]["connection"] == "close"
    time.sleep(0.5)
    assert len(generation_records(pair.decode)) - seen == 1


def test_an_exception_before_the_head_is_a_500_that_closes(gateway: RunningGateway,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(self: ClientResponse, status: int, headers: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(ClientResponse, "start", broken)
    with _connect(gateway) as sock:
        sock.sendall(_post(b"/generate", GENERATE, extra=b"x-request-id: broken-1\r\n") + _post(b"/generate", GENERATE))
        answers, closed = _all_answers(sock)
    assert [a["status"] for a in answers] == [500] and closed, answers
    assert answers[0]["headers"]["x-request-id"] == "broken-1"


def test_an_exception_after_the_head_is_taken_is_never_an_empty_reply(gateway: RunningGateway,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The edge keeps the head to send with the first body part: a failure between the two must still answer
    (uvicorn's cycle had written the head, so a client saw at least a status)."""
    async def broken(self: ClientResponse, data: bytes, *, more: bool = False) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(ClientResponse, "body", broken)
    with _connect(gateway) as sock:
        sock.sendall(_post(b"/generate", GENERATE))
        answers, closed = _all_answers(sock)
    assert closed
    assert [a["status"] for a in answers] == [500], answers
    assert "x-request-id" in answers[0]["headers"]


def test_an_exception_mid_stream_cuts_the_answer_short_and_ends_the_exchange(gateway: RunningGateway,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Never a completed 200 (no chunked terminator), and the exchange does not run on with nobody reading it."""
    body = ClientResponse.body
    calls: list[bool] = []

    async def breaks_second(self: ClientResponse, data: bytes, *, more: bool = False) -> None:
        calls.append(more)
        if len(calls) == 2:
            raise RuntimeError("boom")
        await body(self, data, more=more)

    monkeypatch.setattr(ClientResponse, "body", breaks_second)
    with _connect(gateway) as sock:
        sock.sendall(_post(b"/v1/completions", LONG_STREAM.replace(b"400", b"3000")))  # 30 s of output
        raw = b""
        sock.settimeout(10)
        while chunk := sock.recv(65536):
            raw += chunk
    assert raw.startswith(b"HTTP/1.1 200 ") and not raw.endswith(b"0\r\n\r\n")
    assert wait_for(lambda: not gateway.gateway.exchanges.running, timeout_s=5)


# ── clients that leave, or never read ──────────────────────────────────────────────────────────────────────────────

@pytest.mark.parametrize("path", [b"/generate", b"/generate?via=asgi"])
def test_a_client_gone_with_a_request_pipelined_behind_its_stream_stops_the_stream(gateway: RunningGateway,
                                                                                   pair: EnginePair,
                                                                                   path: bytes) -> None:
    """The running request is not the connection's newest (the pipelined one is): it must hear of the disconnect
    all the same. Unheard, its relay fails on the closed transport, nobody reads its events, decode's read pauses
    at the relay's high-water mark and the exchange holds its decode slot until total_s (30 minutes)."""
    seen = len(generation_records(pair.decode))
    body = b'{"text": "go on", "stream": true, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": true}}'
    with _connect(gateway) as sock:
        sock.sendall(_post(path, body) + _post(b"/generate", GENERATE))
        sock.recv(4096)  # the stream has started
    assert wait_for(lambda: not gateway.gateway.exchanges.running, timeout_s=5), \
        [(e.output.events, e.events.held_bytes, e.client_gone) for e in gateway.gateway.exchanges.running]
    records = wait_for(lambda: [r for r in generation_records(pair.decode)[seen:] if r["outcome"]], timeout_s=10)
    assert records[0]["outcome"] in ("aborted", "client_disconnected"), records


def test_a_client_that_never_reads_holds_bounded_memory(gateway: RunningGateway,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exchange_module, "RELAY_HIGH_WATER", 16 * 1024)
    monkeypatch.setattr(events_module, "RELAY_HIGH_WATER", 16 * 1024)
    monkeypatch.setattr(events_module, "RELAY_LOW_WATER", 4 * 1024)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window stays small
    sock.connect(("127.0.0.1", int(gateway.url.rsplit(":", 1)[1])))
    try:
        # /generate's stream repeats the whole text so far in every event: its bytes grow fast
        body = b'{"text": "go on", "stream": true, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": true}}'
        before = set(gateway.gateway.exchanges.running)
        time.sleep(0.3)
        for conn in gateway.server.server_state.connections:  # the kernel holds little of it either
            conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
        sock.sendall(_post(b"/generate", body))
        time.sleep(6)
        exchanges = [e for e in gateway.gateway.exchanges.running if e not in before]
        assert len(exchanges) == 1
        exchange = exchanges[0]
        held = exchange.events.held_bytes
        assert held < 64 * 1024, held
        events = exchange.output.events
        time.sleep(2)
        assert exchange.output.events == events, "decode is still read while the client reads nothing"
    finally:
        sock.close()
    assert wait_for(lambda: not set(gateway.gateway.exchanges.running) - before, timeout_s=20)


def test_a_client_gone_mid_body_leaves_nothing_and_the_slots_are_given_back(gateway: RunningGateway) -> None:
    for _ in range(20):
        with _connect(gateway) as sock:
            request = _post(b"/generate", GENERATE)
            sock.sendall(request[:-5])
    assert wait_for(lambda: not gateway.gateway.exchanges.running, timeout_s=10)
    with _connect(gateway) as sock:
        sock.sendall(_post(b"/generate", GENERATE))
        answers, _ = _all_answers(sock, settle_s=2)
    assert [a["status"] for a in answers] == [200]


def test_a_body_that_stops_arriving_is_a_408(gateway: RunningGateway) -> None:
    with _connect(gateway) as sock:
        sock.sendall(_post(b"/generate", GENERATE)[:-5])
        answers, closed = _all_answers(sock, settle_s=6)
    assert [a["status"] for a in answers] == [408] and closed, answers
    assert "x-request-id" in answers[0]["headers"]



def test_a_request_asking_to_upgrade_is_served_or_refused_for_its_upgrade(gateway: RunningGateway) -> None:
    """httptools stops at an upgrade (h2c here) and is not resumed: a request with a body behind one is refused
    for its upgrade (400, closed), never told its body is empty; a GET asking for h2c, with no body, is served."""
    with _connect(gateway) as sock:
        sock.sendall(_post(b"/generate", GENERATE, extra=b"connection: upgrade\r\nupgrade: h2c\r\n"))
        answers, _ = _all_answers(sock, settle_s=3)
    assert answers, "no answer"
    assert answers[0]["status"] == 200 or b"upgrade" in answers[0]["body"].lower(), answers[0]["body"]


def test_a_get_asking_for_h2c_is_served_as_http_1_1(gateway: RunningGateway) -> None:
    with _connect(gateway) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: kvgate\r\nconnection: upgrade, http2-settings\r\n"
                     b"upgrade: h2c\r\nhttp2-settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n\r\n")
        answers, _ = _all_answers(sock, settle_s=1)
    assert answers and answers[0]["status"] == 200
