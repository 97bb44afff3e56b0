"""Split text at added tokens exactly as `tokenizers`' AddedVocabulary does.

The tokenizer never merges across an added-token match: it extracts the matches first (leftmost-longest,
non-normalized tokens before normalized ones, honouring single_word / lstrip / rstrip) and encodes each
piece between them on its own. Replicating that split lets a prompt be counted, and cached, per piece.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.admission.gil import YIELD_CHARS, yield_gil
from gateway.admission.tokenizer import AddedToken

# Rust regex `\s` (Unicode White_Space); Python's `\s` also matches U+001C..U+001F, which Rust does not.
_WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_LEADING_SPACE = re.compile(f"[{_WHITE_SPACE}]*")
_TRAILING_SPACE = re.compile(f"[{_WHITE_SPACE}]*\\Z")
_NON_WORD = frozenset(string.whitespace + string.punctuation.replace("_", ""))


class UnsupportedSplit(Exception):
    """The text hits an added-token corner where per-segment encoding would differ; count it in one pass."""


@dataclass(frozen=True, slots=True)
class Segment:
    """A piece of the text: either one added token (`token_id` set) or plain text between them."""

    text: str
    token_id: int | None


def _clearly_not_word(c: str) -> bool:
    """Outside Rust regex `\\w` beyond doubt; anything unclear makes us fall back rather than guess."""
    return c in _NON_WORD


class AddedTokenSplitter:
    """Splits text into plain segments and added-token segments."""

    def __init__(self, added: Iterable[AddedToken]) -> None:
        tokens = list(added)
        self._by_content = {t.content: t for t in tokens}
        # Non-normalized tokens are extracted first; normalized ones then from the remaining pieces
        # (valid only without a normalizer, which ModelTokenizer.segmentable guarantees).
        raw = self._pattern([t for t in tokens if not t.normalized])
        passes = (raw, self._pattern([t for t in tokens if t.normalized]))
        self._passes = [p for p in passes if p is not None]

    @staticmethod
    def _pattern(tokens: list[AddedToken]) -> re.Pattern[str] | None:
        contents = sorted({t.content for t in tokens if t.content}, key=len, reverse=True)
        # Longest alternative first: at the leftmost match position Python's `re` then picks the longest,
        # which is aho-corasick's LeftmostLongest.
        return re.compile("|".join(map(re.escape, contents))) if contents else None

    def split(self, text: str) -> list[Segment]:
        segments = [Segment(text, None)]
        for pattern in self._passes:
            segments = [
                part
                for seg in segments
                for part in (self._split_one(seg.text, pattern) if seg.token_id is None else (seg,))
            ]
        return [s for s in segments if s.text or s.token_id is not None]

    def _split_one(self, text: str, pattern: re.Pattern[str]) -> list[Segment]:
        out: list[Segment] = []
        start_offset = 0
        next_yield = YIELD_CHARS
        for m in pattern.finditer(text):
            if m.start() > next_yield:
                yield_gil()
                next_yield = m.start() + YIELD_CHARS
            token = self._by_content[m.group()]
            start, stop = m.start(), m.end()
            if token.single_word:
                before_ok = start == 0 or _clearly_not_word(text[start - 1])
                after_ok = stop == len(text) or _clearly_not_word(text[stop])
                if not (before_ok and after_ok):
                    # Rejected, the token would stay in a plain segment and match when that is encoded alone.
                    raise UnsupportedSplit
            if start < start_offset:
                if not token.lstrip:
                    raise UnsupportedSplit  # the previous token's rstrip swallowed the start of this match
                start = start_offset
            elif token.lstrip:
                start = _TRAILING_SPACE.search(text, start_offset, start).start()
            if token.rstrip:
                stop = _LEADING_SPACE.match(text, stop).end()
            if start > start_offset:
                out.append(Segment(text[start_offset:start], None))
            out.append(Segment(text[start:stop], token.id))
            start_offset = stop
        if start_offset < len(text):
            out.append(Segment(text[start_offset:], None))
        return out
