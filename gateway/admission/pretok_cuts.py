"""Cut a long text only where the tokenizer's own pre-tokenizer splits the full text.

BPE never merges across a pre-tokenizer split, so pieces cut at such a position count to the same total as
the whole text. Candidates are positions after a newline (or a space) that starts a new word; each is
verified on a window around it: pre-tokenizing the window must put a boundary there, from two different
scan starts, and pre-tokenizing the two halves on their own must reproduce the window's splits exactly
(no look-ahead or greedy run reaches across the cut). For GPT-style split regexes (GLM, Llama 3, Qwen,
DeepSeek) no alternative can match a newline followed by a non-space, nor a non-space followed by a space,
so these boundaries are forced; the window check makes the cutter safe for other pre-tokenizers too.
"""

from __future__ import annotations

from itertools import pairwise

import tokenizers

_WINDOW = 256  # context pre-tokenized on each side of a candidate cut
_MAX_TRIES = 8  # verified candidates per kind before giving up on a stretch of text


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
            if cut is None:
                lo = hi
            else:
                bounds.append(cut)
                lo = cut + piece_chars
        bounds.append(len(text))
        return [text[a:b] for a, b in pairwise(bounds)]

    def _find_cut(self, text: str, lo: int, hi: int) -> int | None:
        for sep in ("\n", " "):
            pos, tries = lo, 0
            while tries < _MAX_TRIES:
                found = text.find(sep, pos, hi)
                if found < 0:
                    break
                pos = found + 1
                cut = found + 1 if sep == "\n" else found  # after a newline; before a space
                if self._plausible(text, cut):
                    tries += 1
                    if self.verified(text, cut):
                        return cut
        return None

    @staticmethod
    def _plausible(text: str, cut: int) -> bool:
        if not 0 < cut < len(text) - 1:
            return False
        if text[cut - 1] == "\n":
            return not text[cut].isspace()
        return not text[cut - 1].isspace() and not text[cut + 1].isspace()

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
