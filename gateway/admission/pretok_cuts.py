"""Cut a long text only where the tokenizer's own pre-tokenizer splits the full text.

BPE never merges across a pre-tokenizer split, so pieces cut at such a position count to the same total as
the whole text. Candidates are positions after a newline, before a space, before punctuation that ends a
word, or between letters and digits; each is verified on a window around it: pre-tokenizing the window must
put a boundary there, from two different scan starts, and pre-tokenizing the two halves on their own must
reproduce the window's splits exactly (no look-ahead or greedy run reaches across the cut). For GPT-style
split regexes (GLM, Llama 3, Qwen, DeepSeek) no alternative can match a newline followed by a non-space, a
non-space followed by a space, a letter followed by punctuation or a letter next to a digit, so these
boundaries are forced; the window check guards other pre-tokenizers.

Candidates are found by C-speed regex scans that skip implausible positions (a run of a million spaces holds
none), and only a few are verified per window: a stretch without a verified cut is simply left uncut.
"""

from __future__ import annotations

import re
from itertools import islice, pairwise

import tokenizers

from gateway.admission.gil import finditer_sliced, pace

_WINDOW = 256  # context pre-tokenized on each side of a candidate cut
_MAX_TRIES = 8  # candidates verified per kind and window before giving up on that stretch of text
# Candidate kinds, best first: (pattern, cut offset from the match's start). Each matches the one character just
# before (offset 1) or after (offset 0) a plausible cut, and starts with a character class that is rare in runs
# of letters, so the scan skips them at C speed: a newline before a word; a single space between words;
# punctuation after a letter (CJK prose often has no spaces or newlines for thousands of characters); a digit
# after a letter, or a letter after a digit (base64, hex, identifiers).
_CANDIDATE_REACH = 2  # characters a candidate match and its look-ahead span
_CANDIDATES = (
    (re.compile(r"\n(?=\S)"), 1),
    (re.compile(r" (?<=\S )(?=\S)"), 0),
    (re.compile(r"[,.;:!?，。！？；：、](?<=[^\W\d_].)"), 0),
    (re.compile(r"\d(?<=[^\W\d_]\d)"), 0),
    (re.compile(r"\d(?=[^\W\d_])"), 1),
)


class PieceCutter:
    def __init__(self, pre_tokenizer: tokenizers.pre_tokenizers.PreTokenizer) -> None:
        self._pre = pre_tokenizer

    def cut(self, text: str, piece_chars: int) -> list[str]:
        """Pieces of about `piece_chars` (one piece where no verified cut exists) that concatenate to `text`."""
        return [text[a:b] for a, b in pairwise(self.bounds(text, 0, len(text), piece_chars))]

    def bounds(self, text: str, start: int, stop: int, piece_chars: int) -> list[int]:
        """`start`, verified cuts about `piece_chars` apart in text[start:stop] (a text the tokenizer sees whole),
        and `stop`."""
        bounds = [start]
        lo = start + piece_chars
        while lo < stop - piece_chars // 2:
            hi = min(lo + piece_chars, stop)
            cut = self._find_cut(text, lo, hi, start, stop)
            pace()
            if cut is None:
                lo = hi
            else:
                bounds.append(cut)
                lo = cut + piece_chars
        bounds.append(stop)
        return bounds

    def _find_cut(self, text: str, lo: int, hi: int, start: int, stop: int) -> int | None:
        for candidates, offset in _CANDIDATES:
            for m in islice(finditer_sliced(candidates, text, lo, hi, _CANDIDATE_REACH), _MAX_TRIES):
                if self.verified(text, cut := m.start() + offset, start, stop):
                    return cut
                pace()
        return None

    def verified(self, text: str, cut: int, start: int = 0, stop: int | None = None) -> bool:
        """True when the pre-tokenizer splits text[start:stop] at `cut` with no effect reaching across it."""
        stop = len(text) if stop is None else stop
        a, b = max(start, cut - _WINDOW), min(stop, cut + _WINDOW)
        whole = self._offsets(text[a:b], a)
        left = self._offsets(text[a:cut], a)
        right = self._offsets(text[cut:b], cut)
        if whole != left + right or not any(s == cut for s, _ in whole):
            return False
        a2 = max(start, cut - _WINDOW // 2 - 1)  # a second scan start, differently aligned
        return a2 == a or any(s == cut for s, _ in self._offsets(text[a2:b], a2))

    def _offsets(self, text: str, base: int) -> list[tuple[int, int]]:
        return [(base + s, base + e) for _, (s, e) in self._pre.pre_tokenize_str(text)]
