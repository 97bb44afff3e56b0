"""Worker slots shared fairly between tenants: no tenant can keep another's large bodies waiting.

A tenant runs at most `share` jobs at once (half the slots, at least one), so with two slots or more another tenant
always finds one free or the next to free up; it holds at most `tenant_waiting` more in line, and its next job beyond
that is refused (429: its own doing) while other tenants' jobs are unaffected. Waiting jobs are served round-robin by
tenant, each on its tenant's home slot when that one is free (a worker's per-tenant caches stay warm there).
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from gateway.errors import GatewayError


@dataclass(slots=True)
class _Turn:
    home: int  # where the job would run best
    slot: asyncio.Future[int] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class FairShare:
    def __init__(self, slots: int, *, tenant_waiting: int = 4, max_waiting: int = 64) -> None:
        self.slots = slots
        self.share = max(1, slots // 2)
        self._tenant_waiting = tenant_waiting
        self._max_waiting = max_waiting
        self._busy = [False] * slots
        self._running: Counter[str] = Counter()
        self._lines: dict[str, deque[_Turn]] = {}  # insertion order is the round-robin order
        self._waiting = 0

    @asynccontextmanager
    async def slot(self, tenant: str, home: int) -> AsyncIterator[int]:
        """A slot for one job of `tenant`, held for the `with` block; raises the GatewayError to answer when the
        tenant's line (429) or every line (503) is full."""
        line = self._lines.get(tenant)
        if line is not None and len(line) >= self._tenant_waiting:
            error = GatewayError(429, f"{len(line)} of your large requests are already waiting to be counted; retry "
                                      "when one is answered", code="admission_busy")
            error.retry_after_s = 1
            raise error
        if self._waiting >= self._max_waiting:
            error = GatewayError(503, "too many large requests are waiting to be counted; retry shortly",
                                 code="admission_busy")
            error.retry_after_s = 1
            raise error
        turn = _Turn(home)
        self._lines.setdefault(tenant, deque()).append(turn)
        self._waiting += 1
        self._serve_next()
        try:
            slot = await turn.slot
        except asyncio.CancelledError:
            if turn.slot.done() and not turn.slot.cancelled():  # given a slot just as it was cancelled
                self._free(tenant, turn.slot.result())
            else:
                self._leave_line(tenant, turn)
            raise
        try:
            yield slot
        finally:
            self._free(tenant, slot)

    def _serve_next(self) -> None:
        """Give free slots to waiting jobs, one tenant at a time in turn, each tenant within its share."""
        while self._waiting and not all(self._busy):
            served = False
            for tenant in list(self._lines):
                if all(self._busy):
                    return
                if self._running[tenant] >= self.share:
                    continue
                line = self._lines.pop(tenant)  # re-inserted at the end: the next free slot goes to another
                turn = line.popleft()
                self._waiting -= 1
                if line:
                    self._lines[tenant] = line
                slot = turn.home if not self._busy[turn.home] else self._busy.index(False)
                self._busy[slot] = True
                self._running[tenant] += 1
                turn.slot.set_result(slot)
                served = True
            if not served:
                return  # every waiting tenant is at its share

    def _leave_line(self, tenant: str, turn: _Turn) -> None:
        line = self._lines.get(tenant)
        if line is not None and turn in line:
            line.remove(turn)
            self._waiting -= 1
            if not line:
                del self._lines[tenant]

    def _free(self, tenant: str, slot: int) -> None:
        self._busy[slot] = False
        self._running[tenant] -= 1
        if self._running[tenant] <= 0:
            del self._running[tenant]
        self._serve_next()
