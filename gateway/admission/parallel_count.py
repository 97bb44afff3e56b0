"""Count many texts on all cores: GIL-free `encode_batch_fast` calls shared with a small helper pool.

Parallelism is ours rather than `tokenizers`' rayon pool, so a small request counted in its own thread is
never queued behind the pieces of a long prompt.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import tokenizers

from gateway.admission.pretok_cuts import PieceCutter

PIECE_CHARS = 1 << 16  # ~15-40 ms of encoding: fine-grained load balancing and early exits, small overhead

# Our own threads do the parallel work; rayon inside each call would only contend with them.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class EncodeFailed(ValueError):
    """`tokenizers` rejected an input (lone surrogates cannot cross into Rust)."""


def encode_lengths(tokenizer: tokenizers.Tokenizer, texts: list[str], add_special_tokens: bool = False) -> list[int]:
    """Token counts of `texts`; releases the GIL while encoding and keeps no token lists."""
    if not texts:
        return []
    try:
        encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
    except TypeError as exc:
        raise EncodeFailed(str(exc)) from exc
    return [len(e) for e in encodings]


Batch = tuple[list[int], list[str]]  # (index of the text each piece belongs to, pieces)


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
        self, tokenizer: tokenizers.Tokenizer, cutter: PieceCutter | None, workers: int, piece_chars: int = PIECE_CHARS
    ) -> None:
        self._tok = tokenizer
        self._cutter = cutter
        self._piece_chars = piece_chars
        self._helpers = max(0, workers - 1)  # the calling thread is the first worker
        self._pool = ThreadPoolExecutor(max(1, self._helpers), thread_name_prefix="tokpiece")

    def lengths(self, texts: list[str], budget: int | None = None, *, cut: bool = True) -> tuple[list[int], bool]:
        """Exact count of each text (add_special_tokens=False) and True; or, once their sum provably exceeds
        `budget`, partial counts (summing to more than `budget`) and False. `cut=False` for texts that may
        hold added tokens: the pre-tokenizer knows nothing of them, so a cut could split one.

        The calling thread drains the batches itself while pool helpers join in, so a request always makes
        progress even when the helpers are busy with another long prompt.
        """
        queue = deque(self._batches(texts, cut))
        tally = _Tally(len(texts), budget)
        helpers = [self._pool.submit(self._drain, queue, tally) for _ in range(min(self._helpers, len(queue) - 1))]
        try:
            self._drain(queue, tally)
        finally:
            queue.clear()  # on error, stop the helpers after their current batch
            for helper in helpers:
                if not helper.cancel():
                    helper.result()
        return tally.totals, not tally.exceeded

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _drain(self, queue: deque[Batch], tally: _Tally) -> None:
        while not tally.exceeded:
            try:
                owners, pieces = queue.popleft()
            except IndexError:
                return
            tally.add(owners, encode_lengths(self._tok, pieces))

    def _batches(self, texts: list[str], cut: bool) -> list[Batch]:
        """Work items of about piece_chars: long texts cut at verified splits, short ones packed together."""
        batches: list[Batch] = []
        owners: list[int] = []
        pieces: list[str] = []
        size = 0
        for i, text in enumerate(texts):
            parts = [text]
            if cut and self._cutter is not None and len(text) > 2 * self._piece_chars:
                parts = self._cutter.cut(text, self._piece_chars)
            for part in parts:
                owners.append(i)
                pieces.append(part)
                size += len(part)
                if size >= self._piece_chars:
                    batches.append((owners, pieces))
                    owners, pieces, size = [], [], 0
        if pieces or not batches:
            batches.append((owners, pieces))
        return batches
