"""Cut a long text only where the tokenizer's own pre-tokenizer splits the full text.

BPE never merges across a pre-tokenizer split, so pieces cut at such a position count to the same total as
the whole text. Candidates are positions after a newline, before a space, or before punctuation that ends
a word; each is verified on a window around it: pre-tokenizing the window must put a boundary there, from
two different scan starts, and pre-tokenizing the two halves on their own must reproduce the window's
splits exactly (no look-ahead or greedy run reaches across the cut). For GPT-style split regexes (GLM,
Llama 3, Qwen, DeepSeek) no alternative can match a newline followed by a non-space, a non-space followed
by a space, or a letter followed by punctuation, so these boundaries are forced; the window check guards
other pre-tokenizers.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from itertools import pairwise

import tokenizers

from gateway.admission.gil import yield_gil

_WINDOW = 256  # context pre-tokenized on each side of a candidate cut
_MAX_TRIES = 8  # verified candidates per kind before giving up on a stretch of text
# Candidate kinds, best first: after a newline; before a space; before punctuation that follows a letter
# (CJK prose often has no spaces or newlines for thousands of characters).
_CANDIDATES = {
    "newline": re.compile("\n"),
    "space": re.compile(" "),
    "punct": re.compile("[,.;:!?，。！？；：、]"),
}


class PieceCutter:
    def __init__(self, pre_tokenizer: tokenizers.pre_tokenizers.PreTokenizer) -> None:
        self._pre = pre_tokenizer

    def cut(self, text: str, piece_chars: int) -> list[str]:
        """Pieces of about `piece_chars` (one piece where no verified cut exists) that concatenate to `text`."""
        bounds = [0]
        lo = piece_chars
        while lo < len(text) - piece_chars // 2:
            hi = min(lo + piece_chars, len(text))
            cut = self._find_cut(text, lo, hi)
            yield_gil()
            if cut is None:
                lo = hi
            else:
                bounds.append(cut)
                lo = cut + piece_chars
        bounds.append(len(text))
        return [text[a:b] for a, b in pairwise(bounds)]

    def _find_cut(self, text: str, lo: int, hi: int) -> int | None:
        for kind in _CANDIDATES:
            tries = 0
            for cut in _positions(text, kind, lo, hi):
                if _plausible(kind, text, cut):
                    tries += 1
                    if self.verified(text, cut):
                        return cut
                    if tries == _MAX_TRIES:
                        break
        return None

    def verified(self, text: str, cut: int) -> bool:
        """True when the pre-tokenizer splits `text` at `cut` with no effect reaching across it."""
        a, b = max(0, cut - _WINDOW), min(len(text), cut + _WINDOW)
        whole = self._offsets(text[a:b], a)
        left = self._offsets(text[a:cut], a)
        right = self._offsets(text[cut:b], cut)
        if whole != left + right or not any(start == cut for start, _ in whole):
            return False
        a2 = max(0, cut - _WINDOW // 2 - 1)  # a second scan start, differently aligned
        return a2 == a or any(start == cut for start, _ in self._offsets(text[a2:b], a2))

    def _offsets(self, text: str, base: int) -> list[tuple[int, int]]:
        return [(base + s, base + e) for _, (s, e) in self._pre.pre_tokenize_str(text)]


def _positions(text: str, kind: str, lo: int, hi: int) -> Iterator[int]:
    """Candidate cuts in [lo, hi): after each newline, else before each separator character."""
    for m in _CANDIDATES[kind].finditer(text, lo, hi):
        yield m.end() if kind == "newline" else m.start()


def _plausible(kind: str, text: str, cut: int) -> bool:
    """Cheap pre-filter: a word must start right after the cut (verification has the final say)."""
    if not 0 < cut < len(text) - 1:
        return False
    if kind == "newline":
        return not text[cut].isspace()
    if kind == "space":
        return not text[cut - 1].isspace() and not text[cut + 1].isspace()
    return text[cut - 1].isalpha()
