"""Paged KV pool: fixed-size pages holding token ids, allocated per request, never zeroed.

Allocations wait FIFO: while one waits, later ones wait behind it even if they would fit (head-of-line blocking, as
the decode's `DecodePreallocQueue.pop_preallocated` breaks at the first request that does not fit). A decode asks
for its prompt and output plus `reserve` tokens of headroom (`num_reserved_decode_tokens`); the headroom must be
free, not held. A request whose headroom could never fit the pool waits for the pool to have its own size free
(SGLang would hold it forever).

Freed pages go back to the *front* of the free list, as SGLang's allocator does (`free_pages = cat(freed,
free_pages)`), so the next request reuses the pages the previous one just wrote: this is what makes a request that
attends over pages nobody wrote for it see another request's tokens.
"""

from __future__ import annotations

import asyncio
from collections import deque


class KVPool:
    def __init__(self, pool_tokens: int, page_size: int) -> None:
        self.page_size = page_size
        self.num_pages = pool_tokens // page_size
        self.capacity = self.num_pages * page_size
        self.slots: list[int] = [0] * self.capacity  # token id last written at each slot
        self._free: deque[int] = deque(range(self.num_pages))
        self._waiters: deque[tuple[int, int, asyncio.Future[list[int]]]] = deque()
        self.used_tokens = 0  # tokens of KV held by live requests (not page-rounded, like num_used_tokens)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _fits(self, tokens: int, reserve: int) -> bool:
        return self.pages_for(min(tokens + reserve, self.capacity)) <= len(self._free)

    def try_alloc(self, tokens: int, reserve: int = 0) -> list[int] | None:
        if self._waiters or not self._fits(tokens, reserve):
            return None
        free = self._free
        pages = [free.popleft() for _ in range(self.pages_for(tokens))]
        self.used_tokens += tokens
        return pages

    async def alloc(self, tokens: int, reserve: int = 0) -> list[int]:
        """Wait silently (FIFO) until `tokens` plus `reserve` fit, like a decode request in the prealloc queue."""
        if self.pages_for(tokens) > self.num_pages:
            raise ValueError(f"{tokens} tokens can never fit a pool of {self.capacity}")
        pages = self.try_alloc(tokens, reserve)
        if pages is not None:
            return pages
        fut: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._waiters.append((tokens, reserve, fut))
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.free(fut.result(), tokens)
            else:
                self._waiters = deque(w for w in self._waiters if w[2] is not fut)
                self._wake()
            raise

    def free(self, pages: list[int], tokens: int) -> None:
        self._free.extendleft(reversed(pages))  # reuse order = the order the pages were held in
        self.used_tokens -= tokens
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            tokens, reserve, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if not self._fits(tokens, reserve):
                return
            self._waiters.popleft()
            fut.set_result([self._free.popleft() for _ in range(self.pages_for(tokens))])
            self.used_tokens += tokens

    # token storage
    def positions(self, pages: list[int], n: int) -> list[int]:
        """Slot index of each of the first n token positions of a request holding `pages`."""
        s = self.page_size
        if s == 1:
            return pages[:n]
        return [pages[i // s] * s + i % s for i in range(n)]

    def write(self, positions: list[int], ids: list[int]) -> None:
        slots = self.slots
        for p, t in zip(positions, ids):
            slots[p] = t

    def read(self, positions: list[int]) -> list[int]:
        slots = self.slots
        return [slots[p] for p in positions]

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def waiting_tokens(self) -> int:
        return sum(t for t, _, f in self._waiters if not f.done())
