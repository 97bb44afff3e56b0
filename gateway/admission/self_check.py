"""Load-time probe of the fast paths on the tokenizer actually loaded.

The tests prove segmenting and cutting exact for the tokenizers kvgate ships; a tokenizer added later gets
the fast paths only if it also passes this probe (~50 ms, once per tokenizer), else it is counted in one pass.
"""

from __future__ import annotations

import itertools

from gateway.admission.parallel_count import encode_lengths
from gateway.admission.pretok_cuts import PieceCutter
from gateway.admission.segmenting import AddedTokenSplitter, UnsupportedSplit
from gateway.admission.tokenizer import ModelTokenizer

_EDGES = ("", " ", "  \n", "\t", "\u3000", "xé")
_MIXED = (
    "The quick brown fox's 12345 jumps.\r\n  def f(x):\n\treturn x * 2  # 注释\n\n你好，世界。テスト 한국어 😀👍🏽 "
    "e\u0301 İß \u00a0 ... --> {\"k\": [1, 2.5e-3]}   \n   end"
)


# (probe, tokenizer identity) -> result; keyed by identity so no tokenizer is kept alive.
_RESULTS: dict[tuple[str, str], bool] = {}


def segmenting_holds(mt: ModelTokenizer) -> bool:
    key = ("segmenting", mt.identity)
    if key not in _RESULTS:
        _RESULTS[key] = _segmenting_holds(mt)
    return _RESULTS[key]


def cutting_holds(mt: ModelTokenizer) -> bool:
    key = ("cutting", mt.identity)
    if key not in _RESULTS:
        _RESULTS[key] = _cutting_holds(mt)
    return _RESULTS[key]


def _segmenting_holds(mt: ModelTokenizer) -> bool:
    """Segment-wise counts equal single-pass counts around every added token, with every edge text."""
    splitter = AddedTokenSplitter(mt.added_tokens)
    probes = [_MIXED] + [
        f"{left}{t.content}{right}{t.content}{_MIXED[:24]}"
        for t in mt.added_tokens
        for left, right in itertools.product(_EDGES, repeat=2)
    ]
    expected: list[int] = []
    tokens: list[int] = []
    plain: list[list[str]] = []
    for probe, n in zip(probes, encode_lengths(mt.tokenizer, probes)):
        try:
            segments = list(splitter.segments(probe))
        except UnsupportedSplit:
            continue  # counted in one pass at run time as well
        expected.append(n)
        texts = [probe[start:stop] for start, stop, token_id in segments if token_id is None]
        tokens.append(len(segments) - len(texts))
        plain.append(texts)
    counts = iter(encode_lengths(mt.tokenizer, [t for texts in plain for t in texts]))
    got = [n_tokens + sum(next(counts) for _ in texts) for n_tokens, texts in zip(tokens, plain)]
    return got == expected


def _cutting_holds(mt: ModelTokenizer) -> bool:
    """Pieces cut at verified pre-tokenizer splits count the same as the whole text."""
    text = _MIXED * 20
    pieces = PieceCutter(mt.tokenizer.pre_tokenizer).cut(text, 48)
    return sum(encode_lengths(mt.tokenizer, pieces)) == encode_lengths(mt.tokenizer, [text])[0]
