"""The generate routes served straight from kvgate's HTTP protocol (gateway.http.edge), over raw sockets: keep-alive,
pipelining, 100-continue, chunked streams, what the edge leaves to ASGI, and a client that leaves."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httptools
import pytest

from gateway.http.edge import EdgeCycle
from loadtests.engine.harness import EnginePair
from tests.engine_records import generation_records, wait_for
from tests.gateway_harness import RunningGateway, model_entry, running_gateway, write_config

GENERATE = b'{"text": "hello there", "sampling_params": {"max_new_tokens": 4}}'
CHAT = b'{"model": "glm-5", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": true}'


@pytest.fixture(scope="module")
def gateway(glm_pair: EnginePair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    config = write_config(tmp_path_factory.mktemp("edge"), [
        model_entry("glm-5", [glm_pair.prefill], [glm_pair.decode], max_prompt_tokens=3000)])
    with running_gateway(config) as running:
        yield running


def _connect(gateway: RunningGateway) -> socket.socket:
    return socket.create_connection(("127.0.0.1", int(gateway.url.rsplit(":", 1)[1])), timeout=20)


def _request(path: bytes, body: bytes, *, request_id: bytes = b"", version: bytes = b"1.1",
             extra: bytes = b"") -> bytes:
    rid = b"x-request-id: %s\r\n" % request_id if request_id else b""
    return (b"POST %s HTTP/%s\r\nhost: kvgate\r\ncontent-type: application/json\r\n%s%scontent-length: %d\r\n\r\n%s"
            % (path, version, rid, extra, len(body), body))


class _Answers:
    """HTTP responses parsed off one socket, in order."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.done: list[dict[str, object]] = []
        self._current: dict[str, object] = {}
        self._parser = httptools.HttpResponseParser(self)

    def on_message_begin(self) -> None:
        self._current = {"headers": {}, "body": b""}

    def on_header(self, name: bytes, value: bytes) -> None:
        self._current["headers"][name.lower().decode()] = value.decode()  # type: ignore[index]

    def on_headers_complete(self) -> None:
        self._current["status"] = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self._current["body"] += body  # type: ignore[operator]

    def on_message_complete(self) -> None:
        self.done.append(self._current)

    def read(self, count: int) -> list[dict[str, object]]:
        while len(self.done) < count:
            data = self.sock.recv(65536)
            if not data:
                break
            self._parser.feed_data(data)
        return self.done

    def closed_by_server(self) -> bool:
        self.sock.settimeout(5)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True


def test_one_connection_carries_whole_answers_and_streams_in_turn(gateway: RunningGateway,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    served_at_edge: list[EdgeCycle] = []
    run = EdgeCycle.run_asgi

    async def counted(cycle: EdgeCycle, app: object) -> None:
        served_at_edge.append(cycle)
        await run(cycle, app)

    monkeypatch.setattr(EdgeCycle, "run_asgi", counted)
    with _connect(gateway) as sock:
        answers = _Answers(sock)
        for n, (path, body) in enumerate([(b"/generate", GENERATE), (b"/v1/chat/completions", CHAT),
                                          (b"/generate", GENERATE)]):
            sock.sendall(_request(path, body, request_id=b"turn-%d" % n))
            answer = answers.read(n + 1)[n]
            headers = answer["headers"]
            assert answer["status"] == 200, answer
            assert headers["x-request-id"] == f"turn-{n}" and "date" in headers  # type: ignore[index,operator]
            if path == b"/generate":
                assert headers["content-length"] == str(len(answer["body"]))  # type: ignore[index,arg-type]
                assert json.loads(answer["body"])["meta_info"]["prompt_tokens"] == int(  # type: ignore[arg-type]
                    headers["x-kvgate-prompt-tokens"])  # type: ignore[index]
            else:
                assert headers["transfer-encoding"] == "chunked"  # type: ignore[index]
                assert answer["body"].endswith(b"data: [DONE]\n\n")  # type: ignore[union-attr]
    assert len(served_at_edge) == 3  # not through ASGI


def test_pipelined_requests_are_answered_in_the_order_sent(gateway: RunningGateway) -> None:
    with _connect(gateway) as sock:
        sock.sendall(b"".join(_request(b"/generate", GENERATE, request_id=b"pipe-%d" % n) for n in range(3))
                     + _request(b"/v1/chat/completions", CHAT, request_id=b"pipe-3"))
        answers = _Answers(sock).read(4)
    assert [a["headers"]["x-request-id"] for a in answers] == ["pipe-0", "pipe-1", "pipe-2", "pipe-3"]  # type: ignore[index]
    assert all(a["status"] == 200 for a in answers)


def test_expect_100_continue_is_answered_before_the_body_is_sent(gateway: RunningGateway) -> None:
    with _connect(gateway) as sock:
        head = _request(b"/generate", GENERATE, extra=b"expect: 100-continue\r\n")[: -len(GENERATE)]
        sock.sendall(head)
        assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(GENERATE)
        answers = _Answers(sock).read(1)
    assert answers[0]["status"] == 200


@pytest.mark.parametrize(("path", "version"), [(b"/generate?trace=1", b"1.1"), (b"/gen%65rate", b"1.1"),
                                               (b"/generate", b"1.0")])
def test_what_the_edge_leaves_to_asgi_is_served_all_the_same(gateway: RunningGateway, path: bytes,
                                                             version: bytes) -> None:
    with _connect(gateway) as sock:
        sock.sendall(_request(path, GENERATE, version=version))
        answers = _Answers(sock)
        answer = answers.read(1)[0]
        assert answer["status"] == 200, answer
        assert json.loads(answer["body"])["meta_info"]["prompt_tokens"] > 0  # type: ignore[arg-type]
        if version == b"1.0":
            assert answers.closed_by_server()


def test_a_get_is_refused_and_an_answer_with_connection_close_closes(gateway: RunningGateway) -> None:
    with _connect(gateway) as sock:
        sock.sendall(b"GET /generate HTTP/1.1\r\nhost: kvgate\r\n\r\n")
        answers = _Answers(sock)
        assert answers.read(1)[0]["status"] == 405
        # A body that is not JSON is refused with 400 and the connection stays; one over the cap closes it.
        sock.sendall(_request(b"/generate", b"{oops"))
        assert answers.read(2)[1]["status"] == 400
        cap = gateway.gateway.config.max_body_bytes
        sock.sendall(b"POST /generate HTTP/1.1\r\nhost: kvgate\r\ncontent-length: %d\r\n\r\n{" % (cap + 1))
        refused = answers.read(3)[2]
        assert refused["status"] == 413 and refused["headers"]["connection"] == "close"  # type: ignore[index]
        assert answers.closed_by_server()


@pytest.mark.parametrize("body", [GENERATE, CHAT])
def test_clients_that_close_as_soon_as_they_sent_leave_nothing_running(gateway: RunningGateway, glm_pair: EnginePair,
                                                                       body: bytes) -> None:
    """Gone before admission ends, or after: the exchange hears of it either way (at once when it registers late)."""
    path = b"/generate" if body is GENERATE else b"/v1/chat/completions"
    seen = len(generation_records(glm_pair.decode))
    for n in range(10):
        with _connect(gateway) as sock:
            sock.sendall(_request(path, body.replace(b"hi", b"hi %d" % n).replace(b"there", b"there %d" % n)))
    wait_for(lambda: not gateway.gateway.exchanges.running, timeout_s=10)
    decode = wait_for(lambda: [r for r in generation_records(glm_pair.decode)[seen:] if r["outcome"]], timeout_s=10)
    assert all(r["outcome"] in ("finished", "aborted", "client_disconnected") for r in decode)
    with _connect(gateway) as sock:  # and the next client is served as before
        sock.sendall(_request(b"/generate", GENERATE))
        assert _Answers(sock).read(1)[0]["status"] == 200
