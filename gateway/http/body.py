"""A client's request body as it arrives: kept in memory while small, spooled to a file once large.

A large body is admitted by a worker process (`gateway.admission.offload`), which reads the file itself: the event
loop never copies, joins or pickles a multi-megabyte body, each of which would hold the GIL for tens of
milliseconds. Writing each arriving chunk to the file is a short system call that releases the GIL.
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING

from gateway.errors import GatewayError

if TYPE_CHECKING:
    from gateway.http.client_link import BodySource

# Bodies up to this size stay in memory and are admitted on the event loop.
INLINE_BODY_BYTES = 64 * 1024


class RequestBody:
    def __init__(self) -> None:
        self.size = 0
        self._parts: list[bytes] = []
        self._fd: int | None = None
        self.path: str | None = None

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self._fd is None and self.size <= INLINE_BODY_BYTES:
            self._parts.append(chunk)
            return
        if self._fd is None:
            self._fd, self.path = tempfile.mkstemp(prefix="kvgate-body-")
            for part in self._parts:
                _write_all(self._fd, part)
            self._parts.clear()
        _write_all(self._fd, chunk)

    @property
    def in_memory(self) -> bytes | None:
        """The whole body when it is small, else None (then read it from `path`)."""
        return b"".join(self._parts) if self._fd is None else None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.path is not None:
            os.unlink(self.path)
            self.path = None

    def __enter__(self) -> RequestBody:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class EncodedBody(GatewayError):
    def __init__(self, encoding: str) -> None:
        super().__init__(415, f"request bodies must not be compressed (Content-Encoding: {encoding}); send plain JSON",
                         code="unsupported_content_encoding")


class BodyTooLarge(GatewayError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds the gateway's limit of {limit} bytes", code="body_too_large")


async def read_body(source: BodySource, body: RequestBody, limit: int) -> None:
    """The whole body into `body`, refusing with 413 as soon as it is known to exceed `limit` (before reading it
    all), with 415 for a compressed one (what is counted must be what was sent, and a small compressed body can
    inflate past any limit). ConnectionAbortedError when the client leaves first."""
    for name, value in source.headers:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise BodyTooLarge(limit)
        if name == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
            raise EncodedBody(value.decode("latin-1"))
    while True:
        chunk, more = await source.receive()
        if body.size + len(chunk) > limit:
            body.size += len(chunk)  # charged to the tenant all the same (it was sent)
            raise BodyTooLarge(limit)
        body.add(chunk)
        if not more:
            return
