"""Early exits never change an accept/reject decision; the cache and the loop behave."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.admission.count_cache import ENTRY_BYTES, CountCache
from gateway.admission.counting import TokenCounter
from gateway.admission.tokenizer import ModelTokenizer
from tests.depth import examples

WORDS = ["the", " cat", "\n", "  ", "你好", "😀", "123", "{", "}", "e\u0301", "<|user|>", "<think>", "\t", "٣٤"]


@pytest.fixture(scope="module")
def counter(glm_tokenizer: ModelTokenizer) -> Iterator[TokenCounter]:
    with TokenCounter(glm_tokenizer, cache_bytes=1 << 20, piece_chars=64) as c:
        yield c


def reference(tok: ModelTokenizer, text: str) -> int:
    return len(tok.tokenizer.encode(text).ids)


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(WORDS), max_size=300).map("".join), st.integers(-3, 3), st.booleans())
def test_limit_never_changes_the_decision(
    glm_tokenizer: ModelTokenizer, counter: TokenCounter, text: str, delta: int, special: bool
) -> None:
    exact = len(glm_tokenizer.tokenizer.encode(text, add_special_tokens=special).ids)
    limit = max(0, exact + delta)
    got = asyncio.run(counter.count(text, tenant=str(delta), add_special_tokens=special, limit=limit))
    assert (got > limit) == (exact > limit)
    if exact <= limit:
        assert got == exact
    bounded = asyncio.run(counter.count_bounded(text, tenant="b", add_special_tokens=special, limit=limit))
    assert bounded.tokens == exact if bounded.exact else limit < bounded.tokens <= exact
    if counter.provably_within(text, limit, add_special_tokens=special):
        assert exact <= limit


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(st.characters(blacklist_categories=["Cs"]), max_size=200))
def test_tokens_never_exceed_bytes_nor_fall_below_the_floor(glm_tokenizer: ModelTokenizer, text: str) -> None:
    n = reference(glm_tokenizer, text)
    assert n <= len(text.encode())
    assert glm_tokenizer.max_token_bytes is not None and n >= -(-len(text) // glm_tokenizer.max_token_bytes)


def test_huge_prompt_rejected_from_its_length_alone(counter: TokenCounter) -> None:
    text = "x" * 5_000_000
    t = time.perf_counter()
    assert asyncio.run(counter.count(text, tenant="t", limit=1_000)) > 1_000
    assert time.perf_counter() - t < 0.5


def test_long_prompt_stops_early_above_limit(glm_tokenizer: ModelTokenizer) -> None:
    text = "Lorem ipsum dolor sit amet.\n" * 40_000  # ~240k tokens
    with TokenCounter(glm_tokenizer, cache_bytes=0) as counter:
        got = asyncio.run(counter.count(text, tenant="t", limit=10_000))
    assert 10_000 < got < reference(glm_tokenizer, text)


def test_resent_conversation_costs_only_the_new_message(glm_tokenizer: ModelTokenizer) -> None:
    rng = random.Random(3)
    turns = ["".join(rng.choice(WORDS[:10]) for _ in range(200)) for _ in range(50)]
    history = "[gMASK]<sop>" + "".join(f"<|user|>{t}<|assistant|></think>reply {i}" for i, t in enumerate(turns))
    with TokenCounter(glm_tokenizer, cache_bytes=1 << 20) as counter:
        asyncio.run(counter.count(history, tenant="a"))
        before = counter.cache_stats
        turn = history + "<|user|>a brand new question<|assistant|><think>"
        assert asyncio.run(counter.count(turn, tenant="a")) == reference(glm_tokenizer, turn)
        after = counter.cache_stats
        assert after.misses - before.misses == 1  # only the new message's text was encoded
        asyncio.run(counter.count(turn, tenant="b"))
        assert counter.cache_stats.misses - after.misses > 50  # another tenant shares nothing


def test_cache_is_lru_and_bounded() -> None:
    cache = CountCache(3 * ENTRY_BYTES)
    for i in range(3):
        cache.put(bytes([i]), i)
    assert cache.get(b"\x00") == 0  # refresh 0: 1 becomes least recently used
    cache.put(b"\x03", 3)
    assert cache.get(b"\x01") is None and cache.get(b"\x00") == 0 and cache.get(b"\x03") == 3
    stats = cache.stats()
    assert (stats.entries, stats.bytes, stats.hits, stats.misses) == (3, 3 * ENTRY_BYTES, 3, 1)


def test_event_loop_keeps_ticking_during_a_long_count(glm_tokenizer: ModelTokenizer) -> None:
    text = ("Some English text, 一些中文, and code: x = f(y) + 1\n" * 25_000) + "<|user|>tail"

    async def run(counter: TokenCounter) -> float:
        lags: list[float] = []
        task = asyncio.ensure_future(counter.count(text, tenant="t"))
        while not task.done():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t - 0.001)
        await task
        return max(lags)

    with TokenCounter(glm_tokenizer, cache_bytes=0) as counter:
        assert asyncio.run(run(counter)) < 0.25  # single-pass `encode` would freeze it for ~0.7 s


def test_early_exit_spares_the_helper_process(glm_tokenizer: ModelTokenizer) -> None:
    """Pieces too long to count in-process (seconds each, in a helper process) come after the others."""
    text = "Lorem ipsum dolor sit amet.\n" * 20_000 + "a" * 3_000_000  # ~120k tokens, then 3M chars with no cut
    with TokenCounter(glm_tokenizer, cache_bytes=0) as counter:
        got = asyncio.run(counter.count_bounded(text, tenant="t", limit=10_000))
        assert not got.exact and 10_000 < got.tokens < reference(glm_tokenizer, text)
        assert counter._isolated._proc is None  # never started
