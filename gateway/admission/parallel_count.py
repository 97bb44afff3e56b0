"""Count many texts on all cores: GIL-free `encode_batch_fast` calls fanned out to a small thread pool.

Parallelism is ours rather than `tokenizers`' rayon pool, so a small request counted in its own thread is
never queued behind the pieces of a long prompt.
"""

from __future__ import annotations

import os
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

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


class ParallelCounter:
    def __init__(
        self, tokenizer: tokenizers.Tokenizer, cutter: PieceCutter | None, workers: int, piece_chars: int = PIECE_CHARS
    ) -> None:
        self._tok = tokenizer
        self._cutter = cutter
        self._piece_chars = piece_chars
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tokpiece")

    def lengths(self, texts: list[str], budget: int | None = None) -> tuple[list[int], bool]:
        """Exact count of each text (add_special_tokens=False) and True; or, once their sum provably exceeds
        `budget`, partial counts (summing to more than `budget`) and False."""
        batches = self._batches(texts)
        totals = [0] * len(texts)
        if len(batches) == 1:
            owners, pieces = batches[0]
            for owner, n in zip(owners, encode_lengths(self._tok, pieces)):
                totals[owner] += n
            return totals, True
        running = 0
        pending: set[Future[tuple[list[int], list[int]]]] = {self._pool.submit(self._run, b) for b in batches}
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    owners, counts = fut.result()
                    for owner, n in zip(owners, counts):
                        totals[owner] += n
                        running += n
                if budget is not None and running > budget:
                    return totals, False
        finally:
            for fut in pending:
                fut.cancel()
        return totals, True

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, batch: tuple[list[int], list[str]]) -> tuple[list[int], list[int]]:
        owners, pieces = batch
        return owners, encode_lengths(self._tok, pieces)

    def _batches(self, texts: list[str]) -> list[tuple[list[int], list[str]]]:
        """Work items of about piece_chars: long texts cut at verified splits, short ones packed together."""
        batches: list[tuple[list[int], list[str]]] = []
        owners: list[int] = []
        pieces: list[str] = []
        size = 0
        for i, text in enumerate(texts):
            parts = [text]
            if self._cutter is not None and len(text) > 2 * self._piece_chars:
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
