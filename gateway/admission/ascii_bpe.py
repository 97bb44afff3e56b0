"""ASCII text encoded as the tokenizer's own `encode` does, at a fifth of its cost.

A GPT-style byte-level BPE tokenizer (GLM, Qwen, Llama 3, cl100k) encodes a text in three steps: its split regex
cuts the text into pieces, ByteLevel maps each piece's bytes to characters, and the BPE model encodes each piece on
its own. Nearly all the time goes to the first step (Oniguruma, ~0.3 µs a character); the model step is a cache hit
for common words. Here only the first step is replaced, and only for ASCII text: the split regex, translated to
ASCII classes (`\\p{L}` → `[A-Za-z]`, `\\p{N}` → `[0-9]`, `\\s` → `[\\t\\n\\v\\f\\r ]`), runs in Python's `re`,
which has Oniguruma's semantics (backtracking, leftmost-first alternation, greedy quantifiers); the pieces are
byte-mapped with the ByteLevel step's own table and encoded by the tokenizer's own BPE model (`model.tokenize`),
whose answers are kept per tenant and piece.

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

from gateway.admission.segmenting import UnsupportedSplit
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
_PIECES_KEPT = 1 << 16  # pieces whose ids are kept, all tenants together (≤ 255 characters: ≲ 40 MiB)
_PIECES_PER_TENANT = 1 << 13
_FUZZ_ALPHABET = "aZ' s\t\n\r\x0b\x0c\x1c\x1f\x00\x7f09.,!?-_(){}[]\"#`~ "
# Longest text encoded here: `re` holds the GIL for a whole scan (~0.05 µs a character), so longer texts go to the
# tokenizer, which releases it. Longest piece: the tokenizer's own BPE cache keeps pieces under 256 bytes, and a
# text with a longer one (a run of letters, of spaces) goes to the tokenizer whole.
MAX_CHARS = 8192
MAX_PIECE_CHARS = 255
_CHECKED: dict[str, AsciiBpe | None] = {}  # tokenizer identity -> its fast path (checked once per tokenizer)


class AsciiBpe:
    """`ids(text)` for a text that `str.isascii()`, holds no added token and is encoded without special tokens.
    Raises UnsupportedSplit for a text with a piece longer than MAX_PIECE_CHARS (left to the tokenizer, which
    releases the GIL: one BPE call over a long piece holds it for milliseconds here)."""

    def __init__(self, tokenizer: ModelTokenizer, split: re.Pattern[str]) -> None:
        self._model: Any = tokenizer.tokenizer.model
        self._findall = split.findall
        self._split = split
        self._byte_level = str.maketrans({chr(b): _byte_level_char(b) for b in range(128)})
        # Each tenant's pieces apart, as the count cache keeps each tenant's texts: a shared cache would tell one
        # tenant, by timing, which pieces another had sent lately.
        self._pieces: dict[str, dict[str, tuple[int, ...]]] = {}
        self._kept = 0
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

    def count(self, text: str, tenant: str) -> int:
        """len(ids(text)), without building the list."""
        pieces = self._pieces_of(text)
        known = self._pieces.get(tenant)
        if known is not None:
            try:
                return sum(map(len, map(known.__getitem__, pieces)))
            except KeyError:  # a new piece (a number, a rare word): the others are still known
                pass
        return sum(len(self._ids_of(piece, tenant)) for piece in pieces)

    def ids(self, text: str, tenant: str) -> list[int]:
        ids: list[int] = []
        for piece in self._pieces_of(text):
            ids.extend(self._ids_of(piece, tenant))
        return ids

    def _pieces_of(self, text: str) -> list[str]:
        pieces: list[str] = self._findall(text)
        if sum(map(len, pieces)) != len(text):
            pieces = split_pieces(self._split, text)
        if pieces and max(map(len, pieces)) > MAX_PIECE_CHARS:
            raise UnsupportedSplit
        return pieces

    def _ids_of(self, piece: str, tenant: str) -> tuple[int, ...]:
        known = self._pieces.get(tenant)
        ids = known.get(piece) if known is not None else None
        if ids is None:
            ids = tuple(token.id for token in self._model.tokenize(piece.translate(self._byte_level)))
            with self._lock:
                if self._kept >= _PIECES_KEPT:
                    self._pieces.clear()  # cheaper than an LRU's bookkeeping on every hit; refilled at ~1 µs a piece
                    self._kept = 0
                mine = self._pieces.setdefault(tenant, {})
                if len(mine) >= _PIECES_PER_TENANT:  # one tenant's new pieces push out only its own
                    self._kept -= len(mine)
                    mine.clear()
                mine[piece] = ids
                self._kept += 1
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
            try:
                if self.ids(probe, "") != encoding.ids or self.count(probe, "") != len(encoding.ids):
                    return False
            except UnsupportedSplit:
                continue
            if pre is not None and [p for p, _ in pre.pre_tokenize_str(probe)] != \
                    [p.translate(self._byte_level) for p in self._pieces_of(probe)]:
                return False
        self._pieces.clear()
        self._kept = 0
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
    return re.compile(translated, re.ASCII) if translated is not None else None  # translate_to_ascii compiled it


def translate_to_ascii(pattern: str) -> str | None:
    """`pattern` (Oniguruma syntax) with its Unicode classes as ASCII classes; None for anything else — constructs
    Python's `re` reads otherwise (`x{4}+` is `(?:x{4})+` there but possessive here, `x{2}?` optional there but lazy
    here, `&&` an intersection there), and patterns that can match the empty string (the two engines step past an
    empty match differently)."""
    out: list[str] = []
    relaxed: list[str] = []  # the pattern with every look-ahead taken as true: it matches "" if `pattern` ever can
    # For each open group: whether it is a look-ahead, whether it is case-insensitive, where its body starts in
    # `relaxed`.
    groups: list[tuple[bool, bool, int]] = []
    branching: list[bool] = []  # for each open group: whether its body holds an alternation or a quantifier
    looking = 0  # look-aheads open
    folding = 0  # case-insensitive groups open
    last = "start"  # what came last: "atom" may be quantified; "quantifier", "start", "look" may not
    # The atom last closed is a group that may not be quantified: its body can match "" (the engines step through
    # such a loop differently), or it branches (a quantified alternation or nested quantifier can backtrack
    # exponentially in Python's re, where Oniguruma fails fast).
    unquantifiable = False

    def emit(token: str) -> None:
        out.append(token)
        if not looking:
            relaxed.append(token)

    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            escape = _ESCAPE.match(pattern, i)
            table = _INSIDE if in_class else _OUTSIDE
            if escape is None or escape.group() not in table:
                return None
            if folding and escape.group().startswith("\\p"):
                # Case-insensitive, Oniguruma lets a class member fold to several characters (ß → ss, ﬁ → fi).
                return None
            emit(table[escape.group()])
            i = escape.end()
            if not in_class:
                last, unquantifiable = "atom", False
        elif in_class:
            if c == "]":
                in_class, last, unquantifiable = False, "atom", False
            elif c == "[" or (c == "^" and pattern[i - 1] != "[") or not " " <= c <= "~" \
                    or pattern[i:i + 2] in ("&&", "||", "--", "~~"):
                return None  # nested classes, set operations, characters beyond ASCII
            emit(c)
            i += 1
        elif c == "[":
            in_class = True
            emit(c)
            i += 1
            if pattern.startswith("^", i):
                emit("^")
                i += 1
        elif c == "(":
            opener = next((o for o in _ALLOWED_GROUP_OPENERS if pattern.startswith(o, i)), None)
            if opener is None:
                if pattern.startswith("(?", i):
                    return None
                opener = "("
            look = opener in ("(?!", "(?=")
            if look:
                if groups:
                    return None  # a look-ahead only at the top level (inside a loop the two engines differ)
                out.append(opener)
                looking += 1
            else:
                emit(opener if opener != "(" else "(?:")
            groups.append((look, opener == "(?i:", len(relaxed)))
            branching.append(False)
            folding += opener == "(?i:"
            i += len(opener)
            last = "start"
        elif c == ")":
            if not groups:
                return None
            look, folds, body_at = groups.pop()
            branches = branching.pop()
            folding -= folds
            if look:
                out.append(")")
                looking -= 1
                last = "look"
                if i + 1 < len(pattern) and pattern[i + 1] != "|":
                    return None  # and only at the end of an alternative
            else:
                unquantifiable = branches or _matches_empty("".join(relaxed[body_at:]))
                emit(")")
                last = "atom"
            i += 1
        elif c == "|":
            branching[:] = [True] * len(branching)
            emit(c)
            i += 1
            last = "start"
        elif c in "?*+{":
            if last != "atom" or unquantifiable:
                return None  # a quantifier of a quantifier, of nothing, of a look-ahead, of a group as above
            count = re.compile(r"\{\d+(,\d*)?\}").match(pattern, i) if c == "{" else None
            if c == "{" and count is None:
                return None
            token = count.group() if count is not None else c
            branching[:] = [True] * len(branching)
            emit(token)
            i += len(token)
            last = "quantifier"
        elif _LITERAL.fullmatch(c):
            emit(c)
            i += 1
            last, unquantifiable = "atom", False
        else:
            return None  # anchors (^ $), the dot, anything else whose ASCII meaning is not certain here
    if in_class or groups or _matches_empty("".join(relaxed)):
        return None
    try:
        re.compile("".join(out), re.ASCII)
    except (re.error, OverflowError, RecursionError):
        return None  # Oniguruma accepts some patterns Python's `re` does not (`a{2}*`)
    return "".join(out)


def _matches_empty(pattern: str) -> bool:
    """Whether `pattern` (no anchors, no look-arounds) matches the empty string; True when it does not compile."""
    try:
        return re.compile(pattern, re.ASCII).fullmatch("") is not None
    except (re.error, OverflowError, RecursionError):
        return True


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
