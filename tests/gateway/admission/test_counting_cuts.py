"""Parallel counting of pieces cut at verified pre-tokenizer splits equals single-pass `encode` exactly."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.admission import gil, isolated_encode
from gateway.admission.counting import TokenCounter
from gateway.admission.isolated_encode import IsolatedCounter
from gateway.admission.parallel_count import EncodeFailed
from gateway.admission.pretok_cuts import PieceCutter
from gateway.admission.tokenizer import ModelTokenizer
from tests.depth import examples

# Adversarial atoms: whitespace runs before words (`\s+(?!\S)`), \r\n mixes, contractions, digit runs
# (`\p{N}{1,3}`), punctuation followed by newlines, combining marks, CJK, emoji, odd Unicode spaces.
ATOMS = st.sampled_from(
    [" ", "  ", "   ", "\n", "\n\n", "\r\n", "\r", "\t", " \n", "\n ", "\u00a0", "\u3000", "\u2028", "\x1c"]
    + ["a", "word", "Word", "'s", "'LL", "don't", "1", "12", "1234567", "٣", "x2", "_", ".", "...", "!?\n", "){"]
    + ["你", "好的。", "テスト", "한국", "😀", "👍🏽", "e\u0301", "\u0301", "ß", "İ", "\ufeff", "<", "|", "\\"]
    + ["，", "、", ";", ":", ","]
)
TEXTS = st.lists(ATOMS, min_size=0, max_size=400).map("".join)


def reference(tok: ModelTokenizer, text: str) -> int:
    return len(tok.tokenizer.encode(text, add_special_tokens=False).ids)


@settings(max_examples=examples(1000), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(TEXTS, st.integers(min_value=1, max_value=40), st.integers(min_value=1, max_value=9))
def test_cut_pieces_sum_to_single_pass(glm_tokenizer: ModelTokenizer, text: str, piece_chars: int, scan: int) -> None:
    assert glm_tokenizer.pretok_cuttable
    with mock.patch.object(gil, "SCAN_CHARS", scan):  # candidates straddle the scan slices' edges
        pieces = PieceCutter(glm_tokenizer.tokenizer.pre_tokenizer).cut(text, piece_chars)
    assert "".join(pieces) == text
    counts = [len(e) for e in glm_tokenizer.tokenizer.encode_batch_fast(pieces, add_special_tokens=False)] if pieces else []
    assert sum(counts) == reference(glm_tokenizer, text)


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(TEXTS, st.sampled_from(["", "<|user|>", "<|assistant|>", "<think>"])), max_size=6))
def test_counter_with_tiny_pieces_equals_single_pass(glm_tokenizer: ModelTokenizer, parts: list[tuple[str, str]]) -> None:
    text = "".join(a + b for a, b in parts)
    with TokenCounter(glm_tokenizer, cache_bytes=1 << 16, piece_chars=16) as counter:
        assert asyncio.run(counter.count(text, tenant="t")) == reference(glm_tokenizer, text)


def test_verified_rejects_cuts_inside_a_pretoken(glm_tokenizer: ModelTokenizer) -> None:
    cutter = PieceCutter(glm_tokenizer.tokenizer.pre_tokenizer)
    text = "alpha beta\ngamma   delta"
    assert cutter.verified(text, text.index("\ngamma") + 1)
    assert cutter.verified(text, text.index(" beta"))
    assert not cutter.verified(text, text.index("lpha"))  # inside a word
    assert not cutter.verified(text, text.index("   delta") + 1)  # inside the run `\s+(?!\S)` matches
    assert cutter.verified(text, text.index("   delta") + 2)  # the run's last space belongs to " delta"


def test_long_segment_counted_in_parallel_is_exact(glm_tokenizer: ModelTokenizer) -> None:
    line = "def f(x):\n    return x * 2  # 注释 😀\n\nThe quick brown fox's 12345 jumps.\r\n"
    text = line * 3000  # ~200k chars: cut into many pieces at piece_chars=4096
    with TokenCounter(glm_tokenizer, cache_bytes=0, piece_chars=4096) as counter:
        assert asyncio.run(counter.count(text, tenant="t")) == reference(glm_tokenizer, text)


def test_cjk_prose_without_spaces_is_cut_at_punctuation(glm_tokenizer: ModelTokenizer) -> None:
    text = "网关在转发请求之前必须确认提示词能放进键值缓存，否则返回错误。" * 2000
    pieces = PieceCutter(glm_tokenizer.tokenizer.pre_tokenizer).cut(text, 1000)
    assert len(pieces) > 50
    assert sum(len(e) for e in glm_tokenizer.tokenizer.encode_batch_fast(pieces)) == reference(glm_tokenizer, text)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(ATOMS, min_size=500, max_size=2500).map("".join), st.integers(min_value=100, max_value=600))
def test_cuts_far_from_text_edges_sum_to_single_pass(glm_tokenizer: ModelTokenizer, text: str, piece_chars: int) -> None:
    """Texts longer than the verification window, so cuts are checked with partial context only."""
    pieces = PieceCutter(glm_tokenizer.tokenizer.pre_tokenizer).cut(text, piece_chars)
    assert "".join(pieces) == text
    assert sum(len(e) for e in glm_tokenizer.tokenizer.encode_batch_fast(pieces)) == reference(glm_tokenizer, text)


@pytest.mark.parametrize(
    "text",
    [" " * 400_000, "\n" * 400_000, "a" * 400_000, "!?" * 200_000, "你" * 400_000, "x" + "  y" * 150_000],
)
def test_stretches_without_a_verified_cut_stay_whole_and_cost_little(glm_tokenizer: ModelTokenizer, text: str) -> None:
    """Implausible candidates never reach Python and only a few plausible ones are verified per window."""
    cutter = PieceCutter(glm_tokenizer.tokenizer.pre_tokenizer)
    t = time.perf_counter()
    bounds = cutter.bounds(text, 0, len(text), 1 << 12)
    assert time.perf_counter() - t < 3
    assert bounds == [0, len(text)]


def test_letter_digit_boundaries_are_cut(glm_tokenizer: ModelTokenizer) -> None:
    text = "".join(f"Zm9v{i}YmFy{i * 7}" for i in range(20_000))  # base64-like: no spaces, newlines or punctuation
    pieces = PieceCutter(glm_tokenizer.tokenizer.pre_tokenizer).cut(text, 4096)
    assert len(pieces) > 50
    assert sum(len(e) for e in glm_tokenizer.tokenizer.encode_batch_fast(pieces)) == reference(glm_tokenizer, text)


@pytest.fixture(scope="module")
def isolating_counter(glm_tokenizer: ModelTokenizer) -> Iterator[TokenCounter]:
    """Counts every piece that may hold more than 12 tokens in the helper process."""
    with TokenCounter(glm_tokenizer, cache_bytes=0, piece_chars=24, isolate_tokens=12) as c:
        yield c


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(TEXTS, st.sampled_from(["", "<|user|>", "<think>"])), max_size=4), st.integers(0, 2))
def test_pieces_counted_in_the_helper_process_are_exact(
    glm_tokenizer: ModelTokenizer, isolating_counter: TokenCounter, parts: list[tuple[str, str]], delta: int
) -> None:
    text = "".join(a + b for a, b in parts)
    expected = reference(glm_tokenizer, text)
    assert asyncio.run(isolating_counter.count(text, tenant="t")) == expected
    limit = max(0, expected - delta)
    got = asyncio.run(isolating_counter.count_bounded(text, tenant="t", limit=limit))
    assert got.tokens == expected if got.exact else limit < got.tokens <= expected
    assert (got.tokens > limit) == (expected > limit)


@pytest.fixture(scope="module")
def isolated(glm_tokenizer: ModelTokenizer) -> Iterator[IsolatedCounter]:
    with IsolatedCounter(glm_tokenizer.source) as c:
        yield c


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(TEXTS, st.integers(0, 400), st.integers(0, 400), st.integers(1, 5))
def test_helper_process_counts_any_span_sent_in_slices(
    glm_tokenizer: ModelTokenizer, isolated: IsolatedCounter, text: str, a: int, b: int, slice_chars: int
) -> None:
    start, stop = sorted((min(a, len(text)), min(b, len(text))))
    with mock.patch.object(isolated_encode, "YIELD_CHARS", slice_chars):  # slices split multi-byte characters' runs
        assert isolated.length(text, start, stop) == reference(glm_tokenizer, text[start:stop])


def test_helper_process_is_restarted_after_dying(glm_tokenizer: ModelTokenizer) -> None:
    text = "Counted in another process. 你好 😀"
    with IsolatedCounter(glm_tokenizer.source) as helper:
        assert helper.length(text, 0, len(text)) == reference(glm_tokenizer, text)
        assert helper._proc is not None
        helper._proc.kill()  # as the kernel's OOM killer or the memory cap would
        with pytest.raises(EncodeFailed, match="tokenizer process failed"):
            helper.length(text, 0, len(text))
        assert helper.length(text, 0, len(text)) == reference(glm_tokenizer, text)
        with pytest.raises(EncodeFailed):
            helper.length("\ud800 lone surrogate", 0, 20)
        assert helper.length(text, 0, len(text)) == reference(glm_tokenizer, text)
    with pytest.raises(EncodeFailed, match="closed"):
        helper.length(text, 0, len(text))
