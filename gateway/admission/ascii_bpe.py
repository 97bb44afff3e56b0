"""ASCII text encoded as the tokenizer's own `encode` does, at a fifth of its cost.

A GPT-style byte-level BPE tokenizer (GLM, Qwen, Llama 3, cl100k) encodes a text in three steps: its split regex
cuts the text into pieces, ByteLevel maps each piece's bytes to characters, and the BPE model encodes each piece on
its own. Nearly all the time goes to the first step (Oniguruma, ~0.3 µs a character); the model step is a cache hit
for common words. Here only the first step is replaced, and only for ASCII text: the split regex, translated to
ASCII classes (`\\p{L}` → `[A-Za-z]`, `\\p{N}` → `[0-9]`, `\\s` → `[\\t\\n\\v\\f\\r ]`), runs in Python's `re`,
which has Oniguruma's semantics (backtracking, leftmost-first alternation, greedy quantifiers); the pieces are
byte-mapped with the ByteLevel step's own table and encoded by the tokenizer's own BPE model (`model.tokenize`),
whose answers are kept per piece.

Exact by construction but for the translation, and the translation covers only what it is sure of: any escape,
class or flag beyond those above and it gives up (the tokenizer is then used whole). `for_tokenizer` also checks
the result against the tokenizer's `encode` on every ASCII character in every context the split regex tells apart
before the fast path is used.
"""

from __future__ import annotations

import itertools
import random
import re
import threading
from typing import Any

import tokenizers

from gateway.admission.tokenizer import ModelTokenizer, pre_tokenizer_parts

# Oniguruma's Unicode classes, restricted to ASCII (\s: White_Space; \x1c-\x1f are not, whatever str.isspace says).
_INSIDE = {r"\p{L}": "A-Za-z", r"\p{N}": "0-9", r"\s": r"\t\n\x0b\x0c\r ", r"\r": r"\r", r"\n": r"\n",
           r"\t": r"\t"}
_OUTSIDE = {r"\p{L}": "[A-Za-z]", r"\p{N}": "[0-9]", r"\s": r"[\t\n\x0b\x0c\r ]", r"\S": r"[^\t\n\x0b\x0c\r ]",
            r"\r": r"\r", r"\n": r"\n", r"\t": r"\t"}
_ESCAPE = re.compile(r"\\p\{[A-Za-z]\}|\\.")
# Outside classes only these constructs pass: groups, non-capturing/case-insensitive groups, negative and
# positive look-ahead, alternation, quantifiers with counts. No anchors, look-behind, backreferences or flags
# that change what a class means.
_ALLOWED_GROUP_OPENERS = ("(?i:", "(?:", "(?!", "(?=")
_LITERAL = re.compile(r"[ !\"#%&',\-/:;<=>@_`~A-Za-z0-9]")
_PIECES_KEPT = 1 << 16  # distinct pieces whose ids are kept (~150 B each)
_FUZZ_ALPHABET = "aZ' s\t\n\r\x0b\x0c\x1c\x1f\x00\x7f09.,!?-_(){}[]\"#`~ "
# Longest text encoded here: `re` holds the GIL for a whole scan (~0.05 µs a character), so longer texts go to the
# tokenizer, which releases it.
MAX_CHARS = 8192
_CHECKED: dict[str, AsciiBpe | None] = {}  # tokenizer identity -> its fast path (checked once per tokenizer)


class AsciiBpe:
    """`ids(text)` for a text that `str.isascii()`, holds no added token and is encoded without special tokens."""

    def __init__(self, tokenizer: ModelTokenizer, split: re.Pattern[str]) -> None:
        self._model: Any = tokenizer.tokenizer.model
        self._findall = split.findall
        self._split = split
        self._byte_level = str.maketrans({chr(b): _byte_level_char(b) for b in range(128)})
        self._pieces: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer: ModelTokenizer) -> AsciiBpe | None:
        """The fast path for this tokenizer, or None where it is not proven to give what `encode` gives."""
        if tokenizer.identity not in _CHECKED:
            split = ascii_split_regex(tokenizer)
            fast = cls(tokenizer, split) if split is not None else None
            _CHECKED[tokenizer.identity] = fast if fast is not None and fast._agrees(tokenizer.tokenizer) else None
        return _CHECKED[tokenizer.identity]

    @staticmethod
    def takes(text: str) -> bool:
        """Whether `text` is for this path: ASCII, and short enough to scan under the GIL."""
        return len(text) <= MAX_CHARS and text.isascii()

    def count(self, text: str) -> int:
        """len(ids(text)), without building the list."""
        pieces = self._pieces_of(text)
        found = self._pieces
        try:
            return sum(map(len, map(found.__getitem__, pieces)))
        except KeyError:  # a new piece (a number, a rare word): the others are still known
            return sum(len(ids) if (ids := found.get(piece)) is not None else len(self._ids_of(piece))
                       for piece in pieces)

    def ids(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._pieces_of(text):
            ids.extend(self._ids_of(piece))
        return ids

    def _pieces_of(self, text: str) -> list[str]:
        pieces: list[str] = self._findall(text)
        return pieces if sum(map(len, pieces)) == len(text) else split_pieces(self._split, text)

    def _ids_of(self, piece: str) -> tuple[int, ...]:
        ids = self._pieces.get(piece)
        if ids is None:
            ids = tuple(token.id for token in self._model.tokenize(piece.translate(self._byte_level)))
            with self._lock:
                if len(self._pieces) >= _PIECES_KEPT:
                    self._pieces.clear()  # cheaper than an LRU's bookkeeping on every hit; refilled at ~1 µs a piece
                self._pieces[piece] = ids
        return ids

    def _agrees(self, tokenizer: tokenizers.Tokenizer) -> bool:
        """Every ASCII character alone and between each pair of the split's classes, and random ASCII texts."""
        chars = [chr(c) for c in range(128)]
        probes = chars + ["".join(p) for p in itertools.product(_FUZZ_ALPHABET[:16], repeat=3)]
        rng = random.Random(0)
        probes += ["".join(rng.choices(chars if i % 4 == 0 else _FUZZ_ALPHABET, k=rng.randint(1, 64)))
                   for i in range(2000)]
        probes += ["Don't we'LL see; it's 1234567 x\r\n\r\n  \t  y   z\n\n\n  ", " " * 17 + "a", "a" + "\n " * 9]
        # Every entry point the prompt reaches is compared on the same texts: the split alone and the ids.
        pre = tokenizer.pre_tokenizer
        expected = tokenizer.encode_batch_fast(probes, add_special_tokens=False)
        for probe, encoding in zip(probes, expected):
            if self.ids(probe) != encoding.ids or self.count(probe) != len(encoding.ids):
                return False
            if pre is not None and [p for p, _ in pre.pre_tokenize_str(probe)] != \
                    [p.translate(self._byte_level) for p in self._pieces_of(probe)]:
                return False
        self._pieces.clear()
        return True


def ascii_split_regex(tokenizer: ModelTokenizer) -> re.Pattern[str] | None:
    """The tokenizer's split regex for ASCII input, where its pipeline is split-regex → ByteLevel → BPE."""
    tok = tokenizer.tokenizer
    model = tok.model
    if tok.normalizer is not None or not isinstance(model, tokenizers.models.BPE) or model.dropout is not None \
            or model.continuing_subword_prefix or model.end_of_word_suffix or tok.pre_tokenizer is None:
        return None
    parts = pre_tokenizer_parts(tokenizer.pre_tokenizer_config)
    if len(parts) != 2:
        return None
    split, byte_level = parts
    if split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert") \
            or byte_level.get("type") != "ByteLevel" or byte_level.get("add_prefix_space") \
            or byte_level.get("use_regex"):
        return None
    pattern = (split.get("pattern") or {}).get("Regex")
    translated = translate_to_ascii(pattern) if isinstance(pattern, str) else None
    return re.compile(translated, re.ASCII) if translated is not None else None


def translate_to_ascii(pattern: str) -> str | None:
    """`pattern` (Oniguruma syntax) with its Unicode classes as ASCII classes; None for anything else."""
    out: list[str] = []
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            escape = _ESCAPE.match(pattern, i)
            if escape is None:
                return None
            table = _INSIDE if in_class else _OUTSIDE
            token = escape.group()
            if token not in table:
                return None
            out.append(table[token])
            i = escape.end()
        elif in_class:
            if c == "]":
                in_class = False
            elif c == "[" or (c == "^" and pattern[i - 1] != "["):
                return None  # nested classes or set operations
            out.append(c)
            i += 1
        elif c == "[":
            in_class = True
            out.append(c)
            i += 1
            if pattern.startswith("^", i):
                out.append("^")
                i += 1
        elif c == "(":
            opener = next((o for o in _ALLOWED_GROUP_OPENERS if pattern.startswith(o, i)), None)
            if opener is None:
                if pattern.startswith("(?", i):
                    return None
                opener = "("
            out.append(opener if opener != "(" else "(?:")
            i += len(opener)
        elif c in ")|?*+":
            out.append(c)
            i += 1
        elif c == "{":
            count = re.compile(r"\{\d+(,\d*)?\}").match(pattern, i)
            if count is None:
                return None
            out.append(count.group())
            i = count.end()
        elif _LITERAL.fullmatch(c):
            out.append(c)
            i += 1
        else:
            return None  # anchors (^ $), the dot, anything else whose ASCII meaning is not certain here
    return "".join(out) if not in_class else None


def split_pieces(split: re.Pattern[str], text: str) -> list[str]:
    """The Split step's "isolated" behaviour: each match is a piece, and so is the text between two matches."""
    pieces, at = [], 0
    for match in split.finditer(text):
        if match.start() > at:
            pieces.append(text[at:match.start()])
        if match.end() > match.start():
            pieces.append(match.group())
        at = match.end()
    if at < len(text):
        pieces.append(text[at:])
    return pieces


def _byte_level_char(byte: int) -> str:
    """The character the ByteLevel step maps `byte` to, asked of the step itself."""
    mapped = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(chr(byte))
    return "".join(piece for piece, _ in mapped)
