"""TokenCounter basics: exact counts, cache keyed by tenant, errors, loop never blocked."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from gateway.admission.counting import TokenCounter, UnencodableText
from gateway.admission.tokenizer import ModelTokenizer

RENDERED = "[gMASK]<sop><|system|>You are helpful.<|user|>What is 2+2? 你好<|assistant|><think>"


@pytest.fixture
def counter(glm_tokenizer: ModelTokenizer) -> Iterator[TokenCounter]:
    with TokenCounter(glm_tokenizer, cache_bytes=1 << 20) as c:
        yield c


def test_tokenizer_facts(glm_tokenizer: ModelTokenizer) -> None:
    assert glm_tokenizer.identity == "19e773648cb4e65de8660ea6365e10acca112d42a854923df93db4a6f333a82d"
    assert glm_tokenizer.tokens_le_bytes and glm_tokenizer.max_token_bytes == 512
    assert "[gMASK]" in glm_tokenizer.special_token_strings() and "<think>" not in glm_tokenizer.special_token_strings()
    assert glm_tokenizer.token_id("<|user|>") == 154827 and glm_tokenizer.token_id("no such token \u2603") is None
    assert glm_tokenizer.special_tokens_added == 0


def test_documented_example_counts_19(counter: TokenCounter) -> None:
    assert counter.count_sync(RENDERED) == 19
    assert asyncio.run(counter.count(RENDERED, tenant="t")) == 19


def test_cache_hits_are_per_tenant(counter: TokenCounter) -> None:
    async def run() -> None:
        await counter.count(RENDERED, tenant="a")
        misses = counter.cache_stats.misses
        await counter.count(RENDERED, tenant="a")
        assert counter.cache_stats.misses == misses
        await counter.count(RENDERED, tenant="b")
        assert counter.cache_stats.misses > misses

    asyncio.run(run())
    assert counter.cache_stats.hits > 0 and counter.cache_stats.bytes > 0


def test_lone_surrogate_is_unencodable(counter: TokenCounter) -> None:
    with pytest.raises(UnencodableText):
        asyncio.run(counter.count("ok \ud800 <|user|>", tenant="t"))
    with pytest.raises(UnencodableText):
        counter.count_sync("\udfff")


def test_empty_text(counter: TokenCounter) -> None:
    assert asyncio.run(counter.count("", tenant="t")) == 0 == counter.count_sync("")
