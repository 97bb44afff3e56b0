"""Hostile review of the Upgrade guard (d2c7a88): what a client can send around it."""

from __future__ import annotations

import pytest

from tests.gateway.http.test_edge_hostile import GENERATE, _all_answers, _connect, _post, gateway, pair  # noqa: F401
from tests.gateway_harness import RunningGateway

pytestmark = pytest.mark.long_running(seconds=30)

H2C = b"connection: upgrade\r\nupgrade: h2c\r\n"


def test_connect_with_a_body_is_never_served(gateway: RunningGateway) -> None:  # noqa: F811
    with _connect(gateway) as sock:
        sock.sendall(_post(b"/generate", GENERATE).replace(b"POST", b"CONNECT", 1))
        answers, closed = _all_answers(sock, settle_s=3)
    assert answers and answers[0]["status"] == 400 and closed, answers


@pytest.mark.parametrize("length", [b"0", b"00", b" 0 "])
def test_an_empty_body_behind_an_upgrade_smuggles_nothing(gateway: RunningGateway, length: bytes) -> None:  # noqa: F811
    head = (b"POST /generate HTTP/1.1\r\nhost: kvgate\r\nauthorization: Bearer %s\r\n%scontent-length: %s\r\n\r\n"
            % (b"sk-hostile", H2C, length))
    with _connect(gateway) as sock:
        sock.sendall(head + _post(b"/generate", GENERATE))
        answers, closed = _all_answers(sock, settle_s=4)
    assert answers, "no answer at all"
    assert answers[0]["status"] != 200 and closed, (answers, closed)



def test_a_request_pipelined_behind_an_h2c_get_is_answered_or_closed(gateway: RunningGateway) -> None:  # noqa: F811
    with _connect(gateway) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: kvgate\r\n" + H2C + b"\r\n" + _post(b"/generate", GENERATE))
        answers, closed = _all_answers(sock, settle_s=4)

    assert answers and answers[0]["status"] == 200
    assert len(answers) == 2 or closed, "the pipelined request was swallowed: no answer, connection held open"


def test_websocket_upgrade_with_a_body_is_refused(gateway: RunningGateway) -> None:  # noqa: F811
    with _connect(gateway) as sock:
        sock.sendall(_post(b"/generate", GENERATE, extra=b"connection: Upgrade\r\nupgrade: WebSocket\r\n"
                                                      b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                                                      b"sec-websocket-version: 13\r\n"))
        answers, closed = _all_answers(sock, settle_s=3)

    assert answers and answers[0]["status"] != 200, answers
