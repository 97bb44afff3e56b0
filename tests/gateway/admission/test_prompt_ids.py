"""Routing's token ids equal the engine's `encode`: GLM-5 chats of every shape, text with special tokens, windows,
and the per-tenant piece cache (a next turn encodes only what is new)."""

from __future__ import annotations

from array import array
from unittest import mock

from gateway.admission.counting import TokenCounter
from gateway.admission.prompt_ids import PromptIds
from gateway.admission.tokenizer import ModelTokenizer
from tests.gateway.admission.test_counting_segments import render_chats


def as_ids(raw: bytes) -> list[int]:
    return array("I", raw).tolist()


def test_glm_chats_get_the_engines_own_ids(glm_tokenizer: ModelTokenizer) -> None:
    with TokenCounter(glm_tokenizer, cache_bytes=1 << 20) as counter:
        assert counter.splitter is not None
        builder = PromptIds(glm_tokenizer, counter.splitter)
        for chat in render_chats(600, seed=7):
            expected = glm_tokenizer.tokenizer.encode(chat, add_special_tokens=False).ids
            assert as_ids(builder.ids(chat, tenant="t", special=False, max_tokens=1 << 20)) == expected
            for special in (True, False):  # completions and /generate text: the post-processor's tokens too
                expected = glm_tokenizer.tokenizer.encode(chat, add_special_tokens=special).ids
                assert as_ids(builder.ids(chat, tenant="u", special=special, max_tokens=1 << 20)) == expected


def test_only_the_window_is_made_and_only_new_pieces_are_encoded(glm_tokenizer: ModelTokenizer) -> None:
    with TokenCounter(glm_tokenizer, cache_bytes=1 << 20) as counter:
        builder = PromptIds(glm_tokenizer, counter.splitter)
        turn = "<|system|>You are helpful.<|user|>" + "tell me about the sea " * 400 + "<|assistant|>"
        full = glm_tokenizer.tokenizer.encode(turn, add_special_tokens=False).ids
        assert as_ids(builder.ids(turn, tenant="t", special=False, max_tokens=100)) == full[:100]
        builder.ids(turn, tenant="t", special=False, max_tokens=1 << 20)
        builder._ascii = None  # every piece through the tokenizer, to see which pieces are encoded at all
        spy = builder._tok = mock.Mock(wraps=glm_tokenizer.tokenizer)
        next_turn = turn + "The sea is large.<|user|>and the sky?<|assistant|>"
        ids = builder.ids(next_turn, tenant="t", special=False, max_tokens=1 << 20)
        assert as_ids(ids) == glm_tokenizer.tokenizer.encode(next_turn, add_special_tokens=False).ids
        encoded = [text for call in spy.encode_batch_fast.call_args_list for text in call.args[0]]
        assert encoded == ["The sea is large.", "and the sky?"]  # the earlier turn came from the cache
        spy.reset_mock()
        builder.ids(turn, tenant="other", special=False, max_tokens=1 << 20)
        assert spy.encode_batch_fast.call_count >= 1  # another tenant's pieces are its own
