"""What the relay receives from an exchange, and the channel it comes through."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from gateway.errors import GatewayError

# Decode payload bytes waiting for a slow client before decode stops reading from the engine (TCP backpressure).
RELAY_HIGH_WATER = 1 << 20
RELAY_LOW_WATER = 1 << 18


@dataclass(frozen=True, slots=True)
class Done:
    """Decode finished, prefill answered 2xx, every reported count verified: the response may be completed."""


@dataclass(frozen=True, slots=True)
class ClientGone:
    """The client disconnected; the relay stops (the exchange itself goes on as the contract says)."""


@dataclass(frozen=True, slots=True)
class Failure:
    """The first failure of an exchange, as the client will see it."""

    error: GatewayError


RelayEvent = bytes | Done | ClientGone | Failure  # bytes: one released decode event payload


class RelayQueue:
    """The exchange → relay channel: one producer (the exchange), one consumer (the relay). It counts the payload
    bytes it holds, so the decode half can wait for a slow client instead of buffering its whole output in the
    gateway. (A deque and one waiter: `asyncio.Queue`'s generality cost a few microseconds per streamed token.)"""

    __slots__ = ("_drained", "_items", "_waiter", "held_bytes")

    def __init__(self) -> None:
        self._items: deque[RelayEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.held_bytes = 0
        self._drained = asyncio.Event()
        self._drained.set()

    def put_nowait(self, item: RelayEvent) -> None:
        self._items.append(item)
        if isinstance(item, bytes):
            self.held_bytes += len(item)
            if self.held_bytes > RELAY_HIGH_WATER:
                self._drained.clear()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> RelayEvent:
        item = self._items.popleft()  # IndexError when empty: callers ask `empty()` first
        if isinstance(item, bytes):
            self.held_bytes -= len(item)
            if self.held_bytes <= RELAY_LOW_WATER:
                self._drained.set()
        return item

    async def get(self) -> RelayEvent:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.get_nowait()

    async def drained(self) -> None:
        await self._drained.wait()
