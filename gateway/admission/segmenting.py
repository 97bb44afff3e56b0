"""Split text at added tokens exactly as `tokenizers`' AddedVocabulary does.

The tokenizer never merges across an added-token match: it extracts the matches first (leftmost-longest,
non-normalized tokens before normalized ones, honouring single_word / lstrip / rstrip) and encodes each
piece between them on its own. Replicating that split lets a prompt be counted, and cached, per piece.

Segments are spans of the prompt, never copies of it, and every scan runs in windows with GIL hand-overs
between them: one `finditer` over megabytes of text would hold the GIL for its whole run.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable, Iterator

from gateway.admission.gil import YIELD_CHARS, finditer_sliced, pace
from gateway.admission.tokenizer import AddedToken

# Rust `char::is_whitespace` (Unicode White_Space, none above U+3000): Python's `str.isspace` also accepts
# U+001C..U+001F, which Rust does not.
_WHITE_SPACE = "".join(c for c in map(chr, range(0x3001)) if c.isspace() and not "\x1c" <= c <= "\x1f")
_NON_SPACE = re.compile(f"[^{re.escape(_WHITE_SPACE)}]")
_NON_WORD = frozenset(string.whitespace + string.punctuation.replace("_", ""))
_Trie = dict[str, "_Trie"]  # a character trie: one child per next character, "" marks the end of a word

# (start, stop, token id): an added token, or plain text between tokens when the id is None.
Segment = tuple[int, int, int | None]


class UnsupportedSplit(Exception):
    """The text hits an added-token corner where per-segment encoding would differ; count it in one pass."""


def _clearly_not_word(c: str) -> bool:
    """Outside Rust regex `\\w` beyond doubt; anything unclear makes us fall back rather than guess."""
    return c in _NON_WORD


class AddedTokenSplitter:
    """Splits text into plain segments and added-token segments."""

    def __init__(self, added: Iterable[AddedToken]) -> None:
        tokens = [t for t in added if t.content]
        self._by_content = {t.content: t for t in tokens}
        self._longest = max((len(t.content) for t in tokens), default=1)
        # Non-normalized tokens are extracted first; normalized ones then from the remaining pieces
        # (valid only without a normalizer, which ModelTokenizer.segmentable guarantees).
        passes = (_pattern([t for t in tokens if not t.normalized]), _pattern([t for t in tokens if t.normalized]))
        self._passes = [p for p in passes if p is not None]

    def segments(self, text: str) -> Iterator[Segment]:
        """The text's added tokens and the non-empty plain spans between them, in order.

        Raises UnsupportedSplit (possibly after yielding some segments) where per-piece counting could differ.
        """
        return self._split(text, 0, len(text), 0)

    def _split(self, text: str, lo: int, hi: int, level: int) -> Iterator[Segment]:
        if level == len(self._passes):
            yield (lo, hi, None)
            return
        for start, stop, token_id in self._scan(text, lo, hi, self._passes[level]):
            if token_id is None:
                yield from self._split(text, start, stop, level + 1)
            else:
                yield (start, stop, token_id)

    def _scan(self, text: str, lo: int, hi: int, pattern: re.Pattern[str]) -> Iterator[Segment]:
        """The split of the piece text[lo:hi] at `pattern`'s tokens."""
        start_offset = lo
        for m in finditer_sliced(pattern, text, lo, hi, self._longest):
            token = self._by_content[m.group()]
            start, stop = m.span()
            if token.single_word:
                before_ok = start == lo or _clearly_not_word(text[start - 1])
                after_ok = stop == hi or _clearly_not_word(text[stop])
                if not (before_ok and after_ok):
                    # Rejected, the token would stay in a plain segment and match when that is encoded alone.
                    raise UnsupportedSplit
            if start < start_offset:
                if not token.lstrip:
                    raise UnsupportedSplit  # the previous token's rstrip swallowed the start of this match
                start = start_offset
            elif token.lstrip:
                start = _space_run_start(text, start_offset, start)
            if token.rstrip:
                stop = _space_run_end(text, stop, hi)
            if start > start_offset:
                yield (start_offset, start, None)
            yield (start, stop, token.id)
            start_offset = stop
        if start_offset < hi:
            yield (start_offset, hi, None)


def _pattern(tokens: list[AddedToken]) -> re.Pattern[str] | None:
    return re.compile(_trie_regex(sorted({t.content for t in tokens}))) if tokens else None


def _trie_regex(words: list[str]) -> str:
    """A regex matching any of `words`, shared prefixes factored out (one test per character, not per word).

    Where a word is a prefix of another, the longer branch is tried first and the shorter is the fallback, so
    at the leftmost matching position the longest word wins: aho-corasick's LeftmostLongest, as tokenizers uses.
    """
    trie: _Trie = {}
    for word in words:
        node = trie
        for c in word:
            node = node.setdefault(c, {})
        node[""] = {}  # a word ends here

    def branch(node: _Trie) -> str:
        alternatives = [re.escape(c) + branch(child) for c, child in node.items() if c]
        if not alternatives:
            return ""
        body = alternatives[0] if len(alternatives) == 1 else f"(?:{'|'.join(alternatives)})"
        return f"(?:{body})?" if "" in node else body

    return branch(trie)


def _space_run_start(text: str, lo: int, hi: int) -> int:
    """Start of the whitespace run ending at `hi`, not before `lo`: linear, sliced, from the end backwards."""
    while hi > lo:
        chunk_start = max(lo, hi - YIELD_CHARS)
        if kept := len(text[chunk_start:hi].rstrip(_WHITE_SPACE)):
            return chunk_start + kept
        hi = chunk_start
        pace()
    return lo


def _space_run_end(text: str, lo: int, hi: int) -> int:
    """End of the whitespace run starting at `lo`, not after `hi`."""
    while lo < hi:
        end = min(lo + YIELD_CHARS, hi)
        if m := _NON_SPACE.search(text, lo, end):
            return m.start()
        lo = end
        pace()
    return hi
