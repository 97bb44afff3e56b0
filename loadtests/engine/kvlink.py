"""The KV handoff between decode and prefill (HTTP stands in for RDMA/ZMQ).

The decode opens one persistent connection per prefill bootstrap address (`GET /kv` + `Upgrade: kvgate-kv` on the
prefill's bootstrap port) and multiplexes rooms over it with newline-delimited JSON frames, so a handoff costs one
small frame each way instead of an HTTP request:

    decode -> prefill  {"op": "claim", "room": R, "dst": n}   pre-allocated n KV slots for the prompt (kv_receiver.init)
                       {"op": "abort", "room": R}             the decode gave up on R (timeout, abort, disconnect)
                       {"op": "reject", "room": R, "msg": s}  fixed mode: decode rejected R at admission
    prefill -> decode  {"room": R, "ok": true, "ids": [...], "first": t}   transfer done (ids = the KV written)
                       {"room": R, "ok": false, "status": c, "msg": s}      handoff failed / rejected
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

UPGRADE_TOKEN = "kvgate-kv"


@dataclass
class Claim:
    channel: PrefillChannel
    dst: int


class Room:
    """Prefill-side meeting point of one prefill request and the decode's claim, whichever arrives first."""

    __slots__ = ("claim", "has_request", "reject_msg")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.claim: asyncio.Future[Claim] = loop.create_future()
        self.has_request = False
        self.reject_msg: str | None = None  # fixed mode: the decode rejected this room


class RoomRegistry:
    def __init__(self, linger_s: float) -> None:
        self.rooms: dict[int, Room] = {}
        self.prefill_rejects: dict[int, str] = {}  # fixed mode: rooms the prefill rejected, answered on claim
        self.channels: set[PrefillChannel] = set()
        self._linger_s = linger_s  # how long a rejection waits for its claim

    def room_for_request(self, room_id: int) -> Room:
        room = self.rooms.get(room_id)
        if room is None:
            room = self.rooms[room_id] = Room(asyncio.get_running_loop())
        room.has_request = True
        return room

    def release(self, room_id: int, room: Room) -> None:
        if self.rooms.get(room_id) is room:
            del self.rooms[room_id]

    def reject_from_prefill(self, room_id: int, msg: str) -> None:
        room = self.rooms.pop(room_id, None)
        if room is not None and room.claim.done():
            room.claim.result().channel.send({"room": room_id, "ok": False, "status": 400, "msg": msg})
            return
        self.prefill_rejects[room_id] = msg
        asyncio.get_running_loop().call_later(self._linger_s, self.prefill_rejects.pop, room_id, None)

    def on_frame(self, channel: PrefillChannel, frame: dict[str, Any]) -> None:
        op, room_id = frame.get("op"), frame.get("room")
        if not isinstance(room_id, int):
            return
        if op == "claim":
            msg = self.prefill_rejects.pop(room_id, None)
            if msg is not None:
                channel.send({"room": room_id, "ok": False, "status": 400, "msg": msg})
                return
            room = self.rooms.get(room_id)
            if room is None:
                room = self.rooms[room_id] = Room(asyncio.get_running_loop())
            if not room.claim.done():
                room.claim.set_result(Claim(channel, int(frame.get("dst", 0))))
        elif op == "abort":
            room = self.rooms.get(room_id)
            if room is not None and not room.has_request:
                del self.rooms[room_id]
        elif op == "reject":
            room = self.rooms.get(room_id)
            if room is None:
                room = self.rooms[room_id] = Room(asyncio.get_running_loop())
            room.reject_msg = str(frame.get("msg", ""))
            if not room.claim.done():
                room.claim.set_exception(RoomRejected(room.reject_msg))
                room.claim.exception()  # mark retrieved: the prefill request may never come

    def close_channels(self) -> None:
        for ch in list(self.channels):
            ch.close()


class RoomRejected(Exception):
    """Fixed mode: the peer rejected this room at admission."""


class _LineProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buf = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data
        if b"\n" not in buf:
            self._buf = buf
            return
        *lines, self._buf = buf.split(b"\n")
        for line in lines:
            if line:
                self.on_line(line)

    def on_line(self, line: bytes) -> None:
        raise NotImplementedError

    def send(self, frame: dict[str, Any]) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(orjson.dumps(frame) + b"\n")

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class PrefillChannel(_LineProtocol):
    """Prefill end of one decode's KV connection (installed by the bootstrap server's upgrade handler)."""

    def __init__(self, registry: RoomRegistry) -> None:
        super().__init__()
        self.registry = registry

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.registry.channels.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.registry.channels.discard(self)

    def on_line(self, line: bytes) -> None:
        self.registry.on_frame(self, orjson.loads(line))


class TransferFailed(Exception):
    def __init__(self, status: int, msg: str) -> None:
        super().__init__(msg)
        self.status = status


class DecodeLink(_LineProtocol):
    """Decode end of the KV connection to one prefill bootstrap address."""

    def __init__(self, on_lost: Callable[[DecodeLink], None]) -> None:
        super().__init__()
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._handshake = True
        self._on_lost = on_lost

    def data_received(self, data: bytes) -> None:
        if self._handshake:
            buf = self._buf + data
            head, sep, rest = buf.partition(b"\r\n\r\n")
            if not sep:
                self._buf = buf
                return
            self._buf = b""
            self._handshake = False
            if head.split(b" ", 2)[1:2] != [b"101"]:
                self.ready.set_exception(ConnectionRefusedError(head.split(b"\r\n", 1)[0].decode("latin-1")))
                self.close()
                return
            self.ready.set_result(None)
            data = rest
        super().data_received(data)

    def on_line(self, line: bytes) -> None:
        frame = orjson.loads(line)
        fut = self.pending.pop(frame.get("room"), None)
        if fut is not None and not fut.done():
            fut.set_result(frame)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ready.done():
            self.ready.set_exception(ConnectionResetError("bootstrap connection closed"))
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(TransferFailed(500, "KV connection to the prefill was lost"))
        self.pending.clear()
        self._on_lost(self)

    def claim(self, room: int, dst: int) -> asyncio.Future[dict[str, Any]]:
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pending[room] = fut
        self.send({"op": "claim", "room": room, "dst": dst})
        return fut

    def abort(self, room: int) -> None:
        self.pending.pop(room, None)
        self.send({"op": "abort", "room": room})

    def reject(self, room: int, msg: str) -> None:
        self.send({"op": "reject", "room": room, "msg": msg})


class DecodeLinks:
    """One DecodeLink per bootstrap address, (re)connected on demand."""

    def __init__(self) -> None:
        self._links: dict[tuple[str, int], asyncio.Future[DecodeLink]] = {}

    async def get(self, host: str, port: int) -> DecodeLink:
        key = (host, port)
        fut = self._links.get(key)
        if fut is not None and fut.done() and fut.exception() is None:
            return fut.result()  # hot path: an established link
        if fut is None:
            fut = self._links[key] = asyncio.ensure_future(self._connect(host, port))
        try:
            return await asyncio.shield(fut)
        except Exception:
            if self._links.get(key) is fut:
                del self._links[key]
            raise

    async def _connect(self, host: str, port: int) -> DecodeLink:
        loop = asyncio.get_running_loop()
        key = (host, port)

        def lost(link: DecodeLink) -> None:
            cur = self._links.get(key)
            if cur is not None and cur.done() and not cur.exception() and cur.result() is link:
                del self._links[key]

        _, link = await loop.create_connection(lambda: DecodeLink(lost), host, port)
        assert link.transport is not None
        link.transport.write(
            f"GET /kv HTTP/1.1\r\nhost: {host}:{port}\r\nconnection: Upgrade\r\nupgrade: {UPGRADE_TOKEN}\r\n\r\n"
            .encode())
        await link.ready
        return link

    def close(self) -> None:
        for fut in self._links.values():
            if fut.done() and not fut.exception():
                fut.result().close()
        self._links.clear()
