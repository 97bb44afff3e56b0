"""Fixtures shared across the suite: the real GLM-5 tokenizer and chat template, and one standard emulated PD pair."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from gateway.admission.chat_template import ChatTemplate
from gateway.admission.tokenizer import ModelTokenizer
from loadtests.engine.harness import EnginePair, start_pair
from tests.gateway_harness import GLM5_TEMPLATE, GLM5_TOKENIZER


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files holding a `long_running` test first: bin/test gives each worker whole files in this order, and a long
    file started last would keep one worker busy long after the other ran out of work."""
    seconds: dict[object, float] = {}
    for item in items:
        marker = item.get_closest_marker("long_running")
        if marker is not None:
            seconds[item.path] = max(seconds.get(item.path, 0.0), marker.kwargs["seconds"])
    items.sort(key=lambda item: -seconds.get(item.path, 0.0))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def glm_tokenizer() -> ModelTokenizer:
    return ModelTokenizer.load(GLM5_TOKENIZER)


@pytest.fixture(scope="session")
def glm_template() -> ChatTemplate:
    return ChatTemplate.for_tokenizer(GLM5_TOKENIZER, GLM5_TEMPLATE)


@pytest.fixture(scope="session")
def glm_pair() -> Iterator[EnginePair]:
    """GLM-5 on SGLang 0.5.23 with room to spare (pools of 20,000 tokens, context 8,192). Tests that inject faults
    scope them to their own requests (`count`, `path`) and may `reset` the engines first."""
    with start_pair(prefill_pool=20000, decode_pool=20000, context_length=8192, model="glm-5",
                    version="0.5.23") as pair:
        yield pair
