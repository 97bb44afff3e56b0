"""Every running exchange of this gateway, and the ids they carry to the engines."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING

from gateway.errors import shutting_down

if TYPE_CHECKING:
    from gateway.pd.exchange import PDExchange


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


class ExchangeRegistry:
    """Owns every running exchange, so none is garbage-collected or forgotten at shutdown; hands out their bootstrap
    rooms and hears of each one closing."""

    def __init__(self, on_closed: Callable[[PDExchange], None] = lambda _: None) -> None:
        self.running: set[PDExchange] = set()
        self.rooms = RoomAllocator()
        self.on_closed = on_closed

    async def drain(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for every exchange to end; cancel those still running and wait until their
        halves are closed and aborted. Returns how many were cancelled."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        # Requests still being admitted or queued when the drain began join `running` later: wait for them too.
        while self.running and (remaining := deadline - loop.time()) > 0:
            await asyncio.wait([exchange.closed for exchange in self.running], timeout=remaining,
                               return_when=asyncio.FIRST_COMPLETED)
        left = list(self.running)
        for exchange in left:
            exchange.fail(shutting_down())
        if left:
            await asyncio.wait([exchange.closed for exchange in left])
        return len(left)
