"""Exact prompt token counting that never blocks the event loop.

A prompt is split at added tokens (the tokenizer never merges across them), each plain segment's count is
cached per tenant, and only the segments not in the cache are encoded, in worker threads with the GIL
released (`encode_batch_fast`; `Tokenizer.encode` holds the GIL for its whole run).
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from gateway.admission.count_cache import CacheStats, CountCache, cache_scope, text_key
from gateway.admission.segmenting import AddedTokenSplitter, Segment, UnsupportedSplit
from gateway.admission.tokenizer import ModelTokenizer


class UnencodableText(ValueError):
    """The text cannot be encoded (e.g. it holds lone surrogates): answer 400."""


class TokenCounter:
    def __init__(
        self, tokenizer: ModelTokenizer, *, cache_bytes: int = 64 * 2**20, threads: int | None = None
    ) -> None:
        self._tok = tokenizer
        self._splitter = AddedTokenSplitter(tokenizer.added_tokens) if tokenizer.segmentable else None
        self._cache = CountCache(cache_bytes)
        self._pool = ThreadPoolExecutor(threads or 2 * (os.cpu_count() or 1), thread_name_prefix="tokcount")

    async def count(
        self, text: str, *, tenant: str, add_special_tokens: bool = False, limit: int | None = None
    ) -> int:
        """Exact token count of `text` as the engine's `encode(text, add_special_tokens=...)` sees it.

        With `limit`, may stop once the count provably exceeds it and return some value > limit.
        """
        job = partial(self._count_blocking, text, tenant, add_special_tokens, limit)
        return await asyncio.get_running_loop().run_in_executor(self._pool, job)

    def count_sync(self, text: str, *, add_special_tokens: bool = False) -> int:
        """Single-pass reference count (no segmenting, no cache)."""
        return self._encode_lengths([text], add_special_tokens)[0]

    @property
    def cache_stats(self) -> CacheStats:
        return self._cache.stats()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _count_blocking(self, text: str, tenant: str, add_special_tokens: bool, limit: int | None) -> int:
        extra = self._tok.special_tokens_added if add_special_tokens else 0
        segments = self._segments(text)
        scope = cache_scope(self._tok.identity, tenant)
        total = extra + sum(1 for s in segments if s.token_id is not None)
        missed: list[tuple[bytes, str]] = []
        for seg in segments:
            if seg.token_id is not None:
                continue
            try:
                key = text_key(scope, seg.text)
            except UnicodeEncodeError as exc:
                raise UnencodableText(str(exc)) from exc
            cached = self._cache.get(key)
            if cached is None:
                missed.append((key, seg.text))
            else:
                total += cached
        if limit is not None and total > limit:
            return total
        for (key, _), n in zip(missed, self._encode_lengths([t for _, t in missed], False)):
            self._cache.put(key, n)
            total += n
        return total

    def _segments(self, text: str) -> list[Segment]:
        if self._splitter is not None:
            try:
                return self._splitter.split(text)
            except UnsupportedSplit:
                pass
        return [Segment(text, None)]

    def _encode_lengths(self, texts: list[str], add_special_tokens: bool) -> list[int]:
        if not texts:
            return []
        try:
            encodings = self._tok.tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        except TypeError as exc:  # lone surrogates cannot cross into Rust
            raise UnencodableText(str(exc)) from exc
        return [len(e) for e in encodings]
