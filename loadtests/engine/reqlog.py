"""Per-request records served by `GET /emu/requests`."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

FINISHED = "finished"
CLIENT_DISCONNECTED = "client_disconnected"
ABORTED = "aborted"
ERROR = "error"


class ReqRecord:
    __slots__ = (
        "arrival",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "cached_tokens",
        "completion_tokens",
        "connection_closed",
        "end",
        "error",
        "extra_key",
        "fault",
        "first_token",
        "outcome",
        "path",
        "prompt_tokens",
        "request_id",
        "rid",
        "role",
        "status",
        "stream",
        "traceparent",
        "transferred_tokens",
    )

    def __init__(self, rid: str, role: str, path: str, stream: bool) -> None:
        self.rid = rid
        self.role = role
        self.path = path
        self.stream = stream
        self.bootstrap_room: int | None = None
        self.bootstrap_host: str | None = None
        self.bootstrap_port: int | None = None
        self.arrival = time.time()
        self.end: float | None = None
        self.outcome: str | None = None  # None while in flight
        self.status: int | None = None
        self.error: str | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens = 0
        self.transferred_tokens: int | None = None
        self.connection_closed: float | None = None
        self.fault: str | None = None
        self.first_token: float | None = None  # when the first output token was produced (decode streams)
        self.traceparent: str | None = None  # the W3C trace context the request came with
        self.request_id: str | None = None  # its x-request-id header
        self.extra_key = ""  # its prefix-cache namespace (cache_salt and extra_key)
        self.cached_tokens = 0  # prompt tokens found in the prefix cache of that namespace

    def finish(self, outcome: str, status: int | None, error: str | None = None) -> None:
        if self.outcome is None:
            self.outcome = outcome
            self.status = status
            self.error = error
            self.end = time.time()

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


class RequestLog:
    def __init__(self, maxlen: int) -> None:
        self.records: deque[ReqRecord] = deque(maxlen=maxlen)

    def add(self, rec: ReqRecord) -> None:
        self.records.append(rec)

    def clear(self) -> None:
        self.records.clear()

    def query(self, rid_prefix: str | None = None, room: int | None = None) -> list[dict[str, Any]]:
        return [r.to_json() for r in self.records
                if (rid_prefix is None or r.rid.startswith(rid_prefix))
                and (room is None or r.bootstrap_room == room)]
