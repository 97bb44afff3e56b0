"""The client's side of one request as the generate routes and the intake see it, whichever way it arrived: straight
from kvgate's HTTP protocol (`gateway.http.edge`, the hot path) or as an ASGI call (the canary's in-process
transport, HTTP/1.0 clients, paths that need decoding)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Protocol

from starlette.types import Receive, Scope, Send

Headers = Sequence[tuple[bytes, bytes]]


class BodySource(Protocol):
    @property
    def headers(self) -> Headers: ...  # names lower-cased, as they came
    @property
    def body_complete(self) -> bool: ...  # the whole body has arrived (reading it cannot wait on the client)

    async def receive(self) -> tuple[bytes, bool]:
        """The next part of the body and whether more follows; ConnectionAbortedError once the client has left."""
        ...


class ClientLink(BodySource, Protocol):
    @property
    def method(self) -> str: ...
    @property
    def client(self) -> tuple[str, int] | None: ...

    def on_disconnect(self, callback: Callable[[], None] | None) -> None:
        """Call `callback` once if the client leaves before its answer is complete (at once if it already has);
        None stops watching."""
        ...

    async def write_head(self, status: int, headers: Headers) -> None: ...
    async def write_body(self, data: bytes, *, more: bool) -> None: ...


class AsgiBody:
    """A `BodySource` over an ASGI call."""

    __slots__ = ("_receive", "_scope")

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self._scope = scope
        self._receive = receive

    @property
    def headers(self) -> Headers:
        return self._scope["headers"]  # type: ignore[no-any-return]

    @property
    def body_complete(self) -> bool:
        return False  # not known through ASGI

    async def receive(self) -> tuple[bytes, bool]:
        message = await self._receive()
        if message["type"] == "http.disconnect":
            raise ConnectionAbortedError
        return message.get("body", b""), message.get("more_body", False)


class AsgiLink(AsgiBody):
    """A `ClientLink` over an ASGI call."""

    __slots__ = ("_send", "_watcher")

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        super().__init__(scope, receive)
        self._send = send
        self._watcher: asyncio.Task[None] | None = None

    @property
    def method(self) -> str:
        return str(self._scope["method"])

    @property
    def client(self) -> tuple[str, int] | None:
        return self._scope.get("client")

    def on_disconnect(self, callback: Callable[[], None] | None) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        if callback is not None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch(callback))

    async def _watch(self, callback: Callable[[], None]) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        callback()

    async def write_head(self, status: int, headers: Headers) -> None:
        await self._send({"type": "http.response.start", "status": status, "headers": list(headers)})

    async def write_body(self, data: bytes, *, more: bool) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": more})
