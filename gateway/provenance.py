"""Output provenance, sampled: does an answer share a long stretch of text with what *another* tenant recently sent?
The incident's leaking answers were fluent text built on someone else's context; status codes and counts saw
nothing.

For a sampled request the gateway checks its answer's character n-grams (after lower-casing and dropping everything
but letters and digits) against a bounded window of other tenants' prompt n-grams, then adds its own prompt's,
tagged with the tenant. Answers are not remembered: two tenants asking alike may well get alike answers (greedy
decoding, common facts), while another tenant's prompt text in an answer is the leak's signature. Only hashes are kept — Python's string hash, salted
per process, so they cannot be looked up elsewhere — never the text. Stored n-grams are taken every `STRIDE`
characters and checked at every position, so any shared stretch of `NGRAM + STRIDE` characters is found.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any

import orjson

NGRAM = 48  # characters: long enough that shared boilerplate ("you are a helpful assistant") rarely reaches it
STRIDE = 8
MAX_TEXT_CHARS = 1 << 16  # of each prompt or answer considered
_NOT_WORD = re.compile(r"[\W_]+")
# Where text lives in requests and answers (never keys such as "role" or ids).
_TEXT_KEYS = frozenset({"content", "text", "prompt", "reasoning_content", "arguments"})


def normalized(text: str) -> str:
    return _NOT_WORD.sub("", text[:MAX_TEXT_CHARS].lower())


def _grams(text: str, step: int) -> Iterator[int]:
    norm = normalized(text)
    for start in range(0, max(0, len(norm) - NGRAM + 1), step):
        yield hash(norm[start:start + NGRAM])


def texts_in(document: Any) -> Iterator[str]:
    """The strings under text-bearing keys of a parsed request or answer, at any depth."""
    if isinstance(document, dict):
        for key, value in document.items():
            if key in _TEXT_KEYS and isinstance(value, str):
                yield value
            else:
                yield from texts_in(value)
    elif isinstance(document, list):
        for item in document:
            yield from texts_in(item)


def answer_text(body: bytes) -> str:
    """The text of an answer as sent: one JSON object, or server-sent events (the last /generate event is whole)."""
    if not body.startswith(b"data:"):
        try:
            return "\n".join(texts_in(orjson.loads(body)))
        except orjson.JSONDecodeError:
            return ""
    parts: list[str] = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: {"):
            try:
                parts.extend(texts_in(orjson.loads(line[6:])))
            except orjson.JSONDecodeError:
                continue
    return "".join(parts)


class ProvenanceWindow:
    """Recent n-gram hashes of sampled prompts and answers, each with the tenant it came from (bounded, LRU)."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._owners: OrderedDict[int, str] = OrderedDict()

    @property
    def capacity(self) -> int:
        return self._capacity

    def remember(self, tenant: str, texts: Iterable[str]) -> None:
        owners = self._owners
        for text in texts:
            for gram in _grams(text, STRIDE):
                owners[gram] = tenant
                owners.move_to_end(gram)
        while len(owners) > self._capacity:
            owners.popitem(last=False)

    def foreign(self, tenant: str, text: str) -> bool:
        """Whether `text` shares an n-gram with another tenant's remembered text."""
        owners = self._owners
        return any((owner := owners.get(gram)) is not None and owner != tenant for gram in _grams(text, 1))
