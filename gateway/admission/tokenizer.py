"""Load a model's tokenizer.json once and derive the facts admission relies on.

Every fact here is derived from the tokenizer's own normalizer / pre-tokenizer / model / added tokens,
never from the model's name, so a new tokenizer gets the fast paths only when they are valid for it.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import tokenizers

# Pre-tokenizers that only cut text (never insert or rewrite characters), so each piece keeps its bytes.
_NON_INSERTING_PRETOKENIZERS = {"Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit"}
# Regex constructs whose match depends on text before the match start: a scan restarted mid-text could differ.
_CONTEXT_SENSITIVE_REGEX = ("(?<=", "(?<!", "\\b", "\\B", "\\G", "^", "$", "\\A", "\\Z", "\\z")


@dataclass(frozen=True, slots=True)
class AddedToken:
    """One entry of tokenizer.json's `added_tokens`, with the flags that govern how it is matched."""

    id: int
    content: str
    special: bool
    lstrip: bool
    rstrip: bool
    normalized: bool
    single_word: bool


class ModelTokenizer:
    """A loaded tokenizer plus what admission may assume about it."""

    identity: str
    source: bytes  # the tokenizer.json it was built from, for a helper process to build the same tokenizer
    tokenizer: tokenizers.Tokenizer
    added_tokens: tuple[AddedToken, ...]
    tokens_le_bytes: bool
    max_token_bytes: int | None
    segmentable: bool
    pretok_cuttable: bool
    special_tokens_added: int
    pre_tokenizer_config: dict[str, Any] | None  # the loaded pre-tokenizer's own serialised configuration

    def __init__(self, raw_json: bytes) -> None:
        self.identity = hashlib.sha256(raw_json).hexdigest()
        self.source = raw_json
        tok = self.tokenizer = tokenizers.Tokenizer.from_str(raw_json.decode("utf-8"))
        # Count what the engine sees: a truncating or padding tokenizer.json would under/over-count.
        tok.no_truncation()
        tok.no_padding()
        tok.encode_special_tokens = False
        self.added_tokens = tuple(
            AddedToken(i, t.content, t.special, t.lstrip, t.rstrip, t.normalized, t.single_word)
            for i, t in sorted(tok.get_added_tokens_decoder().items())
        )
        post = tok.post_processor
        self.special_tokens_added = post.num_special_tokens_to_add(False) if post is not None else 0
        # The components' own serialised configuration, read back from the loaded tokenizer.
        has_normalizer = tok.normalizer is not None
        pre = self.pre_tokenizer_config = (orjson.loads(tok.pre_tokenizer.__getstate__())
                                           if tok.pre_tokenizer is not None else None)
        bpe = isinstance(tok.model, tokenizers.models.BPE)
        self.tokens_le_bytes = not has_normalizer and bpe and _is_byte_level(pre)
        self.max_token_bytes = self._max_token_bytes() if self.tokens_le_bytes else None
        self.segmentable = _segments_are_independent(pre, has_normalizer, self.added_tokens)
        self.pretok_cuttable = not has_normalizer and bpe and _pre_tokenizer_is_local(pre)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ModelTokenizer:
        """The tokenizer in `path` (tokenizer.json, or gzipped); models that share one file share one instance."""
        data = Path(path).read_bytes()
        if str(path).endswith(".gz"):
            data = gzip.decompress(data)
        return _parsed(data)

    def special_token_strings(self) -> list[str]:
        return [t.content for t in self.added_tokens if t.special]

    def token_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def _max_token_bytes(self) -> int | None:
        """Longest byte span one token can cover (byte-level vocab: one char per byte); None if unbounded."""
        if any(t.lstrip or t.rstrip for t in self.added_tokens):
            return None  # a stripping added token swallows an unbounded whitespace run
        longest = max((len(piece) for piece in self.tokenizer.get_vocab(with_added_tokens=False)), default=1)
        added = max((len(t.content.encode("utf-8")) for t in self.added_tokens), default=1)
        return max(longest, added)


@functools.lru_cache(maxsize=4)
def _parsed(raw_json: bytes) -> ModelTokenizer:
    # Parsing takes ~0.7 s for a 150k-token vocabulary; the instance is immutable and safe to share across threads.
    return ModelTokenizer(raw_json)


def pre_tokenizer_parts(pre: dict[str, Any] | None) -> list[dict[str, Any]]:
    if pre is None:
        return []
    if pre.get("type") == "Sequence":
        return list(pre.get("pretokenizers") or ())
    return [pre]


def _is_byte_level(pre: dict[str, Any] | None) -> bool:
    """Byte-level without prefix insertion: with BPE every token covers ≥ 1 input byte, so tokens ≤ bytes."""
    parts = pre_tokenizer_parts(pre)
    byte_levels = [p for p in parts if p.get("type") == "ByteLevel"]
    others_only_cut = all(p.get("type") in _NON_INSERTING_PRETOKENIZERS | {"ByteLevel"} for p in parts)
    no_prefix = all(not p.get("add_prefix_space", False) for p in byte_levels)
    return bool(byte_levels) and others_only_cut and no_prefix


def _pre_tokenizer_is_local(pre: dict[str, Any] | None) -> bool:
    """True when a split point of the full text can be verified from a window around it.

    Requires regex splits without look-behind/anchors (a scan restarted at a split boundary then sees
    exactly what the full scan saw) and no prefix insertion (which would treat each piece as a text start).
    """
    parts = pre_tokenizer_parts(pre)
    if not parts:
        return False
    for p in parts:
        kind = p.get("type")
        if kind == "ByteLevel":
            if p.get("add_prefix_space", False):
                return False
        elif kind == "Split":
            pattern = p.get("pattern") or {}
            regex = pattern.get("Regex", "")
            if p.get("invert") or any(c in _outside_classes(regex) for c in _CONTEXT_SENSITIVE_REGEX):
                return False
        elif kind not in {"Digits", "Punctuation", "Whitespace", "WhitespaceSplit"}:
            return False
    return True


def _outside_classes(regex: str) -> str:
    """The regex with character classes blanked, so `[^...]` is not mistaken for an anchor."""
    out, i, depth = [], 0, 0
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            if depth == 0:
                out.append(regex[i : i + 2])
            i += 2
            continue
        if c == "[":
            depth += 1
        elif c == "]" and depth:
            depth -= 1
        elif depth == 0:
            out.append(c)
        i += 1
    return "".join(out)


def _segments_are_independent(pre: dict[str, Any] | None, has_normalizer: bool, added: tuple[AddedToken, ...]) -> bool:
    """True when text between added tokens tokenizes the same wherever it sits in the prompt.

    The tokenizer processes each piece between added-token matches on its own; only a prefix-inserting
    step that treats the first piece specially (Metaspace prepend_scheme="first") breaks that, and a
    normalized added token matched after a real normalizer is beyond what our splitter replicates.
    """
    for p in pre_tokenizer_parts(pre):
        if p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") == "first":
            return False
    if has_normalizer and any(t.normalized for t in added):
        return False
    return True
