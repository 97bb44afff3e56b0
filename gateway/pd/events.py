"""What the relay receives from an exchange, and the channel it comes through."""

from __future__ import annotations

import asyncio
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


class RelayQueue(asyncio.Queue[RelayEvent]):
    """The exchange → relay channel. It counts the payload bytes it holds, so the decode half can wait for a slow
    client instead of buffering its whole output in the gateway."""

    def __init__(self) -> None:
        super().__init__()
        self.held_bytes = 0
        self._drained = asyncio.Event()
        self._drained.set()

    def _put(self, item: RelayEvent) -> None:
        super()._put(item)
        if isinstance(item, bytes):
            self.held_bytes += len(item)
            if self.held_bytes > RELAY_HIGH_WATER:
                self._drained.clear()

    def _get(self) -> RelayEvent:
        item = super()._get()
        if isinstance(item, bytes):
            self.held_bytes -= len(item)
            if self.held_bytes <= RELAY_LOW_WATER:
                self._drained.set()
        return item

    async def drained(self) -> None:
        await self._drained.wait()
