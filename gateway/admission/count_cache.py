"""Memory-bounded LRU of token counts, keyed by a strong digest of (tokenizer, tenant, text).

The key carries the tenant so that one tenant cannot learn, by timing, whether another sent a text.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

_DIGEST_BYTES = 32
# Approximate resident cost of one entry: 32-byte bytes key (~65 B), small int (~28 B), OrderedDict
# link and dict slot (~100 B). Used for the memory bound and the `bytes` metric.
ENTRY_BYTES = 200
# Hash long text in slices so the UTF-8 conversion never holds the GIL for long (hashlib frees it itself).
_HASH_SLICE_CHARS = 1 << 18


@dataclass(frozen=True, slots=True)
class CacheStats:
    hits: int
    misses: int
    bytes: int
    entries: int


def cache_scope(identity: str, tenant: str) -> bytes:
    """Key prefix binding entries to one tokenizer and one tenant (length-prefixed: no ambiguity)."""
    parts = (identity.encode(), tenant.encode("utf-8", "surrogatepass"))
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)


def text_key(scope: bytes, text: str, start: int = 0, stop: int | None = None) -> bytes:
    """SHA-256 over the scope and the UTF-8 of text[start:stop]; raises UnicodeEncodeError for lone surrogates."""
    stop = len(text) if stop is None else stop
    h = hashlib.sha256(scope)
    for i in range(start, stop, _HASH_SLICE_CHARS):
        h.update(text[i : min(i + _HASH_SLICE_CHARS, stop)].encode("utf-8"))
    return h.digest()


class CountCache:
    """Thread-safe LRU: digest → token count, evicting least recently used entries beyond `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self._max_entries = max(0, max_bytes // ENTRY_BYTES)
        self._entries: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    def get(self, key: bytes) -> int | None:
        with self._lock:
            count = self._entries.get(key)
            if count is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return count

    def put(self, key: bytes, count: int) -> None:
        if self._max_entries == 0:
            return
        with self._lock:
            self._entries[key] = count
            self._entries.move_to_end(key)
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)

    def stats(self) -> CacheStats:
        with self._lock:
            n = len(self._entries)
            return CacheStats(hits=self._hits, misses=self._misses, bytes=n * ENTRY_BYTES, entries=n)
