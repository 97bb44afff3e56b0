"""Parallel counting of pieces cut at verified pre-tokenizer splits equals single-pass `encode` exactly."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.admission.counting import TokenCounter
from gateway.admission.pretok_cuts import PieceCutter
from gateway.admission.tokenizer import ModelTokenizer

GLM5 = Path(__file__).resolve().parents[1] / "config" / "models" / "glm-5" / "tokenizer.json.gz"
# Adversarial atoms: whitespace runs before words (`\s+(?!\S)`), \r\n mixes, contractions, digit runs
# (`\p{N}{1,3}`), punctuation followed by newlines, combining marks, CJK, emoji, odd Unicode spaces.
ATOMS = st.sampled_from(
    [" ", "  ", "   ", "\n", "\n\n", "\r\n", "\r", "\t", " \n", "\n ", "\u00a0", "\u3000", "\u2028", "\x1c"]
    + ["a", "word", "Word", "'s", "'LL", "don't", "1", "12", "1234567", "٣", "x2", "_", ".", "...", "!?\n", "){"]
    + ["你", "好的。", "テスト", "한국", "😀", "👍🏽", "e\u0301", "\u0301", "ß", "İ", "\ufeff", "<", "|", "\\"]
    + ["，", "、", ";", ":", ","]
)
TEXTS = st.lists(ATOMS, min_size=0, max_size=400).map("".join)


@pytest.fixture(scope="module")
def glm() -> ModelTokenizer:
    return ModelTokenizer.load(GLM5)


def reference(tok: ModelTokenizer, text: str) -> int:
    return len(tok.tokenizer.encode(text, add_special_tokens=False).ids)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(TEXTS, st.integers(min_value=1, max_value=40))
def test_cut_pieces_sum_to_single_pass(glm: ModelTokenizer, text: str, piece_chars: int) -> None:
    assert glm.pretok_cuttable
    pieces = PieceCutter(glm.tokenizer.pre_tokenizer).cut(text, piece_chars)
    assert "".join(pieces) == text
    counts = [len(e) for e in glm.tokenizer.encode_batch_fast(pieces, add_special_tokens=False)] if pieces else []
    assert sum(counts) == reference(glm, text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(TEXTS, st.sampled_from(["", "<|user|>", "<|assistant|>", "<think>"])), max_size=6))
def test_counter_with_tiny_pieces_equals_single_pass(glm: ModelTokenizer, parts: list[tuple[str, str]]) -> None:
    text = "".join(a + b for a, b in parts)
    counter = TokenCounter(glm, cache_bytes=1 << 16, piece_chars=16)
    try:
        assert asyncio.run(counter.count(text, tenant="t")) == reference(glm, text)
    finally:
        counter.close()


def test_verified_rejects_cuts_inside_a_pretoken(glm: ModelTokenizer) -> None:
    cutter = PieceCutter(glm.tokenizer.pre_tokenizer)
    text = "alpha beta\ngamma   delta"
    assert cutter.verified(text, text.index("\ngamma") + 1)
    assert cutter.verified(text, text.index(" beta"))
    assert not cutter.verified(text, text.index("lpha"))  # inside a word
    assert not cutter.verified(text, text.index("   delta") + 1)  # inside the run `\s+(?!\S)` matches
    assert cutter.verified(text, text.index("   delta") + 2)  # the run's last space belongs to " delta"


def test_long_segment_counted_in_parallel_is_exact(glm: ModelTokenizer) -> None:
    line = "def f(x):\n    return x * 2  # 注释 😀\n\nThe quick brown fox's 12345 jumps.\r\n"
    text = line * 3000  # ~200k chars: cut into many pieces at piece_chars=4096
    counter = TokenCounter(glm, cache_bytes=0, piece_chars=4096)
    try:
        assert asyncio.run(counter.count(text, tenant="t")) == reference(glm, text)
    finally:
        counter.close()


def test_cjk_prose_without_spaces_is_cut_at_punctuation(glm: ModelTokenizer) -> None:
    text = "网关在转发请求之前必须确认提示词能放进键值缓存，否则返回错误。" * 2000
    pieces = PieceCutter(glm.tokenizer.pre_tokenizer).cut(text, 1000)
    assert len(pieces) > 50
    assert sum(len(e) for e in glm.tokenizer.encode_batch_fast(pieces)) == reference(glm, text)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(ATOMS, min_size=500, max_size=2500).map("".join), st.integers(min_value=100, max_value=600))
def test_cuts_far_from_text_edges_sum_to_single_pass(glm: ModelTokenizer, text: str, piece_chars: int) -> None:
    """Texts longer than the verification window, so cuts are checked with partial context only."""
    pieces = PieceCutter(glm.tokenizer.pre_tokenizer).cut(text, piece_chars)
    assert "".join(pieces) == text
    assert sum(len(e) for e in glm.tokenizer.encode_batch_fast(pieces)) == reference(glm, text)
