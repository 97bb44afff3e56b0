"""Segmenting at added tokens equals single-pass `encode`: GLM-5 chats and toy tokenizers with every flag."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from typing import Any
from unittest import mock

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

from gateway.admission import gil, segmenting, self_check
from gateway.admission.counting import TokenCounter
from gateway.admission.tokenizer import ModelTokenizer
from tests.depth import examples
from tests.gateway_harness import GLM5_TEMPLATE

GLM_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
FRAGMENTS = [
    "hello", " world", "  ", "\n", "\r\n", "\t", " \n ", "你好", "世界。", "😀", "e\u0301", "x_1", "don't", "'S",
    "123456", "3.14", "def f(x):\n    return x", "{\"k\": [1, 2]}", "\u00a0", "\u3000", "\x1c", "...", "--", "Ωmega",
]


def reference(tok: ModelTokenizer, text: str) -> int:
    return len(tok.tokenizer.encode(text, add_special_tokens=False).ids)


def render_chats(n: int, seed: int) -> list[str]:
    """Multi-turn GLM-5 chats with tool calls, unicode and whitespace at every segment edge."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v, ensure_ascii=True, **_: json.dumps(v, ensure_ascii=ensure_ascii)
    template = env.from_string(GLM5_TEMPLATE.read_text(encoding="utf-8"))
    rng = random.Random(seed)

    def text() -> str:
        body = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randrange(0, 30)))
        edge = ["", " ", "\n", "  \n", "\t", "\u3000"]
        return rng.choice(edge) + body + rng.choice(edge)

    chats = []
    for _ in range(n):
        messages: list[dict[str, Any]] = [{"role": "system", "content": text()}]
        for _ in range(rng.randrange(1, 6)):
            messages.append({"role": "user", "content": text() + rng.choice(["", "<|user|>", "<think>", "[gMASK]x"])})
            call = {"function": {"name": "run", "arguments": {"cmd": text(), "n": rng.randrange(9)}}}
            reply = {"role": "assistant", "content": text(), "reasoning_content": text()}
            if rng.random() < 0.4:
                reply["tool_calls"] = [call]
                messages += [reply, {"role": "tool", "content": text()}]
            else:
                messages.append(reply)
        tools = [{"name": "run", "description": text()}] if rng.random() < 0.3 else None
        chats.append(template.render(messages=messages, tools=tools, add_generation_prompt=rng.random() < 0.8))
    return chats


def test_glm_chat_corpus_equals_single_pass(glm_tokenizer: ModelTokenizer) -> None:
    assert glm_tokenizer.segmentable
    chats = render_chats(3000, seed=1)

    async def run(counter: TokenCounter) -> list[int]:
        return [await counter.count(c, tenant="t") for c in chats]

    with TokenCounter(glm_tokenizer, cache_bytes=1 << 20) as counter:
        assert asyncio.run(run(counter)) == [reference(glm_tokenizer, c) for c in chats]


def toy_tokenizer(flagged: list[AddedToken], *, normalizer: Any = None, pre: Any = None) -> ModelTokenizer:
    """A small byte-level BPE trained in-process, carrying added tokens with the given flags."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre or pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(GLM_SPLIT), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(FRAGMENTS * 50, trainer)
    tok.add_special_tokens([t for t in flagged if t.special])
    tok.add_tokens([t for t in flagged if not t.special])
    return ModelTokenizer(tok.to_str().encode())


FLAGGED = [
    AddedToken("<L>", lstrip=True, normalized=False, special=True),
    AddedToken("<R>", rstrip=True, normalized=False, special=True),
    AddedToken("<LR>", lstrip=True, rstrip=True, normalized=False, special=True),
    AddedToken("word", single_word=True, normalized=False, special=False),
    AddedToken("<n>", normalized=True, special=False),
    AddedToken("<LR>x", normalized=False, special=False),  # longer overlapping token: leftmost-longest
    AddedToken("<", normalized=True, special=False),
    AddedToken("x. y\nz", normalized=False, special=False),  # holds cut candidates of the pre-tokenizer
]
TOY_ALPHABET = FRAGMENTS + [t.content for t in FLAGGED] + [" ", "  ", "\n", "wordy", "a"]


@pytest.fixture(scope="module")
def toy() -> ModelTokenizer:
    return toy_tokenizer(FLAGGED)


@settings(max_examples=examples(1000), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(TOY_ALPHABET), max_size=40).map("".join), st.integers(1, 6), st.integers(1, 6))
def test_flags_lstrip_rstrip_single_word_normalized(toy: ModelTokenizer, text: str, scan: int, run: int) -> None:
    assert toy.segmentable and toy.pretok_cuttable
    with TokenCounter(toy, cache_bytes=0, piece_chars=4) as counter:  # tiny pieces: cuts next to flagged tokens too
        # Tiny scan windows and whitespace-run slices: token matches and runs cross their edges.
        with mock.patch.object(gil, "SCAN_CHARS", scan), mock.patch.object(segmenting, "YIELD_CHARS", run):
            assert asyncio.run(counter.count(text, tenant="t")) == reference(toy, text)


@pytest.mark.parametrize(
    "text",
    [
        " " * 200_000 + "x" + " " * 9 + "<L>",  # lstrip: a long run just before the token's own run
        ("y" + " " * 50_000) * 6 + "<LR>" + " " * 200_000 + "z",  # lstrip and rstrip over long runs
        "<R>" + " " * 300_000 + "<L>" + "\u3000" * 1000 + "w",  # rstrip's run reaching an lstrip token
        ("<L>" + " " * 20_000) * 40,
    ],
)
def test_stripping_tokens_next_to_long_whitespace_runs(toy: ModelTokenizer, text: str) -> None:
    """Finding the whitespace an lstrip/rstrip token swallows is linear (a regex search was quadratic)."""
    with TokenCounter(toy, cache_bytes=0) as counter:
        t = time.perf_counter()
        got = asyncio.run(counter.count(text, tenant="t"))
        assert time.perf_counter() - t < 5
        assert got == reference(toy, text)


@pytest.mark.parametrize(
    ("normalizer", "pre", "segmentable", "le_bytes"),
    [
        (normalizers.NFC(), None, False, False),  # normalized added tokens behind a real normalizer
        (None, pre_tokenizers.Metaspace(prepend_scheme="first"), False, False),  # first segment is special
        (None, pre_tokenizers.ByteLevel(add_prefix_space=True), True, False),  # inserts a space per piece
    ],
)
def test_unproven_tokenizers_fall_back_and_stay_exact(
    normalizer: Any, pre: Any, segmentable: bool, le_bytes: bool
) -> None:
    tok = toy_tokenizer(FLAGGED, normalizer=normalizer, pre=pre)
    assert (tok.segmentable, tok.tokens_le_bytes) == (segmentable, le_bytes)
    rng = random.Random(7)
    texts = ["".join(rng.choice(TOY_ALPHABET) for _ in range(30)) for _ in range(200)]
    with TokenCounter(tok, cache_bytes=1 << 16) as counter:
        assert [asyncio.run(counter.count(t, tenant="t")) for t in texts] == [reference(tok, t) for t in texts]


def test_post_processor_tokens_are_added_once() -> None:
    tok = toy_tokenizer(FLAGGED)
    tok.tokenizer.post_processor = processors.TemplateProcessing(
        single="<L> $A <R>", special_tokens=[("<L>", tok.token_id("<L>") or 0), ("<R>", tok.token_id("<R>") or 0)]
    )
    tok = ModelTokenizer(tok.tokenizer.to_str().encode())
    assert tok.special_tokens_added == 2
    with TokenCounter(tok, cache_bytes=1 << 16) as counter:
        for text in ["", "word <LR> x", "你好<n>"]:
            expected = len(tok.tokenizer.encode(text, add_special_tokens=True).ids)
            assert asyncio.run(counter.count(text, tenant="t", add_special_tokens=True)) == expected
            assert counter.count_sync(text, add_special_tokens=True) == expected


def test_load_time_probe_disables_a_broken_fast_path(glm_tokenizer: ModelTokenizer) -> None:
    assert self_check.segmenting_holds(glm_tokenizer) and self_check.cutting_holds(glm_tokenizer)
    # Facts that misdescribe the tokenizer (an lstrip flag dropped) make segmenting miscount: the probe notices.
    toy = toy_tokenizer([*FLAGGED, AddedToken("<probe>", normalized=False)])  # an identity not probed yet
    toy.added_tokens = tuple(dataclasses.replace(t, lstrip=False) for t in toy.added_tokens)
    assert not self_check.segmenting_holds(toy)
