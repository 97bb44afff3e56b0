"""Count many texts on all cores: GIL-free `encode_batch_fast` calls shared with a small helper pool.

Parallelism is ours rather than `tokenizers`' rayon pool, so a small request counted in its own thread is
never queued behind the pieces of a long prompt. Texts are spans of a prompt, copied only piece by piece; a
piece so long that converting it for `tokenizers` and freeing its encoding would hold the GIL for more than a
few ms (a long stretch without a verified cut) is counted by a `SpanCounter` in another process.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import pairwise
from typing import Protocol

import tokenizers

from gateway.admission.gil import pace
from gateway.admission.pretok_cuts import PieceCutter

PIECE_CHARS = 1 << 16  # ~15-40 ms of encoding: fine-grained load balancing and early exits, small overhead
# Most tokens a piece counted in-process may have: its encoding is freed under the GIL at ~6 ns a token.
ISOLATE_TOKENS = 1 << 19

# Our own threads do the parallel work; rayon inside each call would only contend with them.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

Span = tuple[str, int, int]  # (text, start, stop): the text to count is text[start:stop]


class EncodeFailed(ValueError):
    """`tokenizers` rejected an input (lone surrogates cannot cross into Rust) or failed on it."""


class SpanCounter(Protocol):
    def length(self, text: str, start: int, stop: int) -> int:
        """Token count of text[start:stop]; raises EncodeFailed."""


def encode_lengths(tokenizer: tokenizers.Tokenizer, texts: list[str], add_special_tokens: bool = False) -> list[int]:
    """Token counts of `texts`; releases the GIL while encoding and keeps no token lists."""
    if not texts:
        return []
    try:
        encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
    except TypeError as exc:
        raise EncodeFailed(str(exc)) from exc
    except BaseException as exc:
        # A Rust panic, e.g. Oniguruma's retry limit on ~10M whitespace characters in a row: the engine's own
        # tokenizer fails on the same text. PanicException derives from BaseException; let others through.
        if type(exc).__module__ != "pyo3_runtime":
            raise
        raise EncodeFailed(f"the tokenizer failed: {exc}") from exc
    return [len(e) for e in encodings]


Batch = tuple[list[int], list[str]]  # (index of the span each piece belongs to, pieces)


@dataclass(frozen=True, slots=True)
class Plan:
    """How some spans are counted: batches of pieces encoded here, and pieces counted in a helper process."""

    spans: int
    batches: list[Batch]
    isolated: list[tuple[int, Span]]  # (index of the span, piece)


class _Tally:
    """Per-text totals shared by the threads draining one request's batches."""

    def __init__(self, n_texts: int, budget: int | None) -> None:
        self.totals = [0] * n_texts
        self.exceeded = False
        self._running = 0
        self._budget = budget
        self._lock = threading.Lock()

    def add(self, owners: list[int], counts: list[int]) -> None:
        with self._lock:
            for owner, n in zip(owners, counts):
                self.totals[owner] += n
            self._running += sum(counts)
            if self._budget is not None and self._running > self._budget:
                self.exceeded = True


class ParallelCounter:
    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        cutter: PieceCutter | None,
        workers: int,
        piece_chars: int = PIECE_CHARS,
        *,
        isolated: SpanCounter,
        isolate_tokens: int = ISOLATE_TOKENS,
    ) -> None:
        self._tok = tokenizer
        self._cutter = cutter
        self._piece_chars = piece_chars
        self._isolated = isolated
        self._isolate_tokens = isolate_tokens
        self._helpers = max(0, workers - 1)  # the calling thread is the first worker
        self._pool = ThreadPoolExecutor(max(1, self._helpers), thread_name_prefix="tokpiece")

    def plan(self, spans: list[Span], *, cut: bool = True) -> Plan:
        """Batches of about piece_chars (long spans cut at verified splits, short ones packed together), and the
        pieces too long to count in-process. `cut=False` for texts that may hold added tokens: the
        pre-tokenizer knows nothing of them, so a cut could split one."""
        batches: list[Batch] = []
        isolated: list[tuple[int, Span]] = []
        owners: list[int] = []
        pieces: list[str] = []
        size = 0
        for i, (text, start, stop) in enumerate(spans):
            bounds = [start, stop]
            if cut and self._cutter is not None and stop - start > 2 * self._piece_chars:
                bounds = self._cutter.bounds(text, start, stop, self._piece_chars)
            # At most one token per UTF-8 byte for byte-level BPE: an estimate for other tokenizers, fine for sizing.
            tokens_per_char = 1 if text.isascii() else 4
            for a, b in pairwise(bounds):
                pace()
                if (b - a) * tokens_per_char > self._isolate_tokens:
                    isolated.append((i, (text, a, b)))
                    continue
                owners.append(i)
                pieces.append(text[a:b])
                size += b - a
                if size >= self._piece_chars:
                    batches.append((owners, pieces))
                    owners, pieces, size = [], [], 0
        if pieces or not batches:
            batches.append((owners, pieces))
        return Plan(len(spans), batches, isolated)

    def lengths(self, plan: Plan, budget: int | None = None) -> tuple[list[int], bool]:
        """The count of each planned span (add_special_tokens=False), and whether every piece was counted: once
        their sum provably exceeds `budget`, the pieces not started yet are skipped (the sum still exceeds it).

        The calling thread drains the batches itself while pool helpers join in, so a request always makes
        progress even when the helpers are busy with another long prompt. Pieces counted in the helper process
        come last: an early exit may spare them (each takes seconds).
        """
        queue = deque(plan.batches)
        tally = _Tally(plan.spans, budget)
        helpers = [self._pool.submit(self._drain, queue, tally) for _ in range(min(self._helpers, len(queue) - 1))]
        try:
            self._drain(queue, tally)
        finally:
            skipped = bool(queue)  # left by an early exit (or taken by a helper just now: then merely understated)
            queue.clear()  # on error, stop the helpers after their current batch
            for helper in helpers:
                if not helper.cancel():
                    helper.result()
        for owner, (text, start, stop) in plan.isolated:
            if tally.exceeded:
                return tally.totals, False
            tally.add([owner], [self._isolated.length(text, start, stop)])
        return tally.totals, not skipped

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _drain(self, queue: deque[Batch], tally: _Tally) -> None:
        while not tally.exceeded:
            try:
                owners, pieces = queue.popleft()
            except IndexError:
                return
            tally.add(owners, encode_lengths(self._tok, pieces))
