"""Exact prompt token counting that never blocks the event loop.

A prompt is split at added tokens (the tokenizer never merges across them); each plain segment's count is
cached per tenant, and only the segments missing from the cache are encoded: long ones cut at verified
pre-tokenizer splits and counted on all cores, in worker threads with the GIL released
(`encode_batch_fast`; `Tokenizer.encode` holds the GIL for its whole run). Every step over a long prompt works
in slices and hands the GIL over between them; a piece without a verified cut for megabytes, whose conversion
for `tokenizers` and freeing alone would hold the GIL for long, is counted in a helper process. A short ASCII
text (the commonest prompt) is encoded without the tokenizer's Oniguruma regex, most of `encode`'s cost
(`gateway.admission.ascii_bpe`).
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial

from gateway.admission.ascii_bpe import AsciiBpe
from gateway.admission.count_cache import CacheStats, CountCache, cache_scope, text_key
from gateway.admission.gil import pace, start_pacing
from gateway.admission.isolated_encode import IsolatedCounter
from gateway.admission.parallel_count import (
    ISOLATE_TOKENS,
    PIECE_CHARS,
    EncodeFailed,
    ParallelCounter,
    Span,
    encode_lengths,
)
from gateway.admission.pretok_cuts import PieceCutter
from gateway.admission.segmenting import AddedTokenSplitter, Segment, UnsupportedSplit
from gateway.admission.self_check import cutting_holds, segmenting_holds
from gateway.admission.tokenizer import ModelTokenizer


class UnencodableText(ValueError):
    """The text cannot be encoded (e.g. it holds lone surrogates): answer 400."""


# Prompts up to this many characters are counted on the event loop: at most ~0.5 ms of encoding, cheaper than
# the thread hop, far below the 10 ms loop-lag budget.
INLINE_CHARS = 1024
# Prompts longer than this (up to ~0.2 s of Python-bound preparation) are prepared one at a time.
SERIAL_CHARS = 1 << 20
_TINY_CHARS = 64  # plain texts up to this long are copied out and deduplicated by value


@dataclass(frozen=True, slots=True)
class CountResult:
    tokens: int
    exact: bool  # False after an early exit: `tokens` is then only a lower bound, above the limit


@dataclass
class _Plain:
    """A prompt's plain text between added tokens, grouped for counting."""

    text: str
    added: int = 0  # added tokens
    # Tiny plain texts, copied out and counted by occurrence (a prompt can hold millions of `<|user|>x`);
    # longer ones as spans of the prompt, hashed and later cut straight from it.
    tiny: dict[str, int] = field(default_factory=dict)
    spans: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def of(cls, text: str, segments: Iterable[Segment]) -> _Plain:
        plain = cls(text)
        for start, stop, token_id in segments:
            pace()
            if token_id is not None:
                plain.added += 1
            elif stop - start <= _TINY_CHARS:
                part = text[start:stop]
                plain.tiny[part] = plain.tiny.get(part, 0) + 1
            else:
                plain.spans.append((start, stop))
        return plain

    def counted(self) -> Iterator[tuple[Span, int]]:
        """Each distinct tiny text and each span, with its occurrences."""
        for part, times in self.tiny.items():
            yield (part, 0, len(part)), times
        for start, stop in self.spans:
            yield (self.text, start, stop), 1


class TokenCounter:
    def __init__(
        self,
        tokenizer: ModelTokenizer,
        *,
        cache_bytes: int = 64 * 2**20,
        threads: int | None = None,
        piece_chars: int = PIECE_CHARS,
        isolate_tokens: int = ISOLATE_TOKENS,
        single_pass_chars: int = 0,
    ) -> None:
        """`threads`: cores used to count one long prompt (default: all); `piece_chars`: parallel work unit;
        `isolate_tokens`: pieces that may hold more tokens are counted in a helper process; `single_pass_chars`:
        texts up to this long are encoded whole, as the engine does, without segments or the cache (for a short
        prompt their bookkeeping cost ~40% on top of the encoding, and a hit saved little)."""
        self._single_pass_chars = single_pass_chars
        cores = threads or os.cpu_count() or 1
        self._tok = tokenizer
        segmentable = tokenizer.segmentable and segmenting_holds(tokenizer)
        cuttable = tokenizer.pretok_cuttable and cutting_holds(tokenizer)
        self._splitter = AddedTokenSplitter(tokenizer.added_tokens) if segmentable else None
        # Short ASCII texts split at added tokens are encoded without Oniguruma (its regex is most of the cost).
        self._ascii = AsciiBpe.for_tokenizer(tokenizer) if self._splitter is not None or not tokenizer.added_tokens \
            else None
        cutter = PieceCutter(tokenizer.tokenizer.pre_tokenizer) if cuttable else None
        self._isolated = IsolatedCounter(tokenizer.source)
        self._parallel = ParallelCounter(
            tokenizer.tokenizer, cutter, cores, piece_chars, isolated=self._isolated, isolate_tokens=isolate_tokens
        )
        self._cache = CountCache(cache_bytes)
        self._preparing = threading.Lock()
        # Request threads mostly wait (in GIL-free encoding or on piece workers), so allow several at once.
        self._requests = ThreadPoolExecutor(4 * cores, thread_name_prefix="tokcount")

    async def count(
        self, text: str, *, tenant: str, add_special_tokens: bool = False, limit: int | None = None
    ) -> int:
        """Exact token count of `text` as the engine's `encode(text, add_special_tokens=...)` sees it.

        With `limit`, may stop once the count provably exceeds it and return some value > limit.
        Raises UnencodableText for text the tokenizer cannot encode.
        """
        result = await self.count_bounded(text, tenant=tenant, add_special_tokens=add_special_tokens, limit=limit)
        return result.tokens

    async def count_bounded(
        self, text: str, *, tenant: str, add_special_tokens: bool = False, limit: int | None = None
    ) -> CountResult:
        """As `count`, telling an exact count from an early exit's lower bound."""
        if len(text) <= self._single_pass_chars:
            return CountResult(self.count_sync(text, add_special_tokens=add_special_tokens, tenant=tenant), exact=True)
        if len(text) <= INLINE_CHARS:
            # A thread hop costs more than encoding a short prompt (~60 µs of CPU against ~115 µs measured).
            return self._count_blocking(text, tenant, add_special_tokens, limit)
        job = partial(self._count_blocking, text, tenant, add_special_tokens, limit)
        return await asyncio.get_running_loop().run_in_executor(self._requests, job)

    def count_sync(self, text: str, *, add_special_tokens: bool = False, tenant: str = "") -> int:
        """Single-pass count (no count cache, no parallelism; `tenant`: whose pieces the ASCII path may reuse)."""
        if self._ascii is not None and self._ascii.takes(text):
            start_pacing()  # splitting a short text at added tokens must not hand the GIL over on the event loop
            try:
                return self._extra(add_special_tokens) + self._ascii_count(text, self._ascii, tenant)
            except UnsupportedSplit:
                pass
        try:
            return encode_lengths(self._tok.tokenizer, [text], add_special_tokens)[0]
        except EncodeFailed as exc:
            raise UnencodableText(str(exc)) from exc

    def _ascii_count(self, text: str, fast: AsciiBpe, tenant: str) -> int:
        """Raises UnsupportedSplit where the text is for the tokenizer after all."""
        if self._splitter is None:  # a tokenizer without added tokens
            return fast.count(text, tenant)
        return sum(1 if token_id is not None else fast.count(text[start:stop], tenant)
                   for start, stop, token_id in self._splitter.segments(text))

    def provably_within(self, text: str, limit: int, *, add_special_tokens: bool = False) -> bool:
        """True when count(text) ≤ limit follows from the byte length alone (O(1); needs tokens ≤ bytes)."""
        if not self._tok.tokens_le_bytes:
            return False
        max_bytes = len(text) if text.isascii() else 4 * len(text)
        return max_bytes + self._extra(add_special_tokens) <= limit

    def remember(self, text: str, tenant: str, tokens: int) -> None:
        """`text` (a piece between added tokens) encodes to `tokens` ids: what another step encoded anyway (the
        cache-aware routing ids) need not be encoded again to be counted."""
        try:
            self._cache.put(text_key(cache_scope(self._tok.identity, tenant), text), tokens)
        except UnicodeEncodeError:
            pass  # the count will refuse it

    @property
    def splitter(self) -> AddedTokenSplitter | None:
        """The split at added tokens, where it is proven exact for this tokenizer."""
        return self._splitter

    @property
    def cache_stats(self) -> CacheStats:
        return self._cache.stats()

    def __enter__(self) -> TokenCounter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the counting threads and the helper process."""
        self._requests.shutdown(wait=False, cancel_futures=True)
        self._parallel.close()
        self._isolated.close()

    def _extra(self, add_special_tokens: bool) -> int:
        return self._tok.special_tokens_added if add_special_tokens else 0

    def _count_blocking(self, text: str, tenant: str, add_special_tokens: bool, limit: int | None) -> CountResult:
        start_pacing()  # a short prompt, counted on the event loop, must not sleep there
        total = self._extra(add_special_tokens)
        if limit is not None and self._tok.max_token_bytes:
            # A token covers at most max_token_bytes bytes, hence at most that many characters.
            floor = total + math.ceil(len(text) / self._tok.max_token_bytes)
            if floor > limit:
                return CountResult(floor, exact=False)
        # Long prompts are prepared one at a time: under the GIL their Python-bound steps would not run in parallel
        # anyway, and each thread busy with them is one more that the event loop must win the GIL from.
        with self._preparing if len(text) > SERIAL_CHARS else nullcontext():
            known, missed, cut = self._lookup(text, tenant)
            if len(text) <= INLINE_CHARS and (cut or not self._tok.added_tokens):
                known += self._count_ascii_here(missed, tenant)
            total += known
            budget = None if limit is None else limit - total
            if budget is not None and budget < 0:
                return CountResult(total, exact=not missed)
            plan = self._parallel.plan([span for span, _ in missed.values()], cut=cut)
        try:
            counts, complete = self._parallel.lengths(plan, budget)
        except EncodeFailed as exc:
            raise UnencodableText(str(exc)) from exc
        if complete:
            for key, n in zip(missed, counts):
                self._cache.put(key, n)
        return CountResult(total + sum(n * times for n, (_, times) in zip(counts, missed.values())), complete)

    def _count_ascii_here(self, missed: dict[bytes, tuple[Span, int]], tenant: str) -> int:
        """The missed texts (free of added tokens) that the ASCII path takes, counted, cached and removed."""
        fast, tokens = self._ascii, 0
        if fast is None:
            return 0
        for key, ((text, start, stop), times) in list(missed.items()):
            part = text[start:stop]
            if fast.takes(part):
                try:
                    n = fast.count(part, tenant)
                except UnsupportedSplit:
                    continue  # a piece too long for this path: the tokenizer counts this text
                self._cache.put(key, n)
                tokens += n * times
                del missed[key]
        return tokens

    def _lookup(self, text: str, tenant: str) -> tuple[int, dict[bytes, tuple[Span, int]], bool]:
        """Tokens known without encoding (added tokens, cached texts); the plain texts to encode, by cache key,
        with their occurrences; and whether those may be cut (they hold no added token)."""
        plain, cut = self._plain(text)
        known = plain.added
        scope = cache_scope(self._tok.identity, tenant)
        missed: dict[bytes, tuple[Span, int]] = {}
        for span, times in plain.counted():
            pace()
            try:
                key = text_key(scope, *span)
            except UnicodeEncodeError as exc:
                raise UnencodableText(str(exc)) from exc
            if key in missed:
                missed[key] = (span, missed[key][1] + times)
            elif (cached := self._cache.get(key)) is None:
                missed[key] = (span, times)
            else:
                known += cached * times
        return known, missed, cut

    def _plain(self, text: str) -> tuple[_Plain, bool]:
        """The plain text between added tokens, and whether it was split there (else: the whole text, uncut)."""
        if self._splitter is not None:
            try:
                return _Plain.of(text, self._splitter.segments(text)), True
            except UnsupportedSplit:
                pass
        return _Plain.of(text, [(0, len(text), None)]), False
