"""The text provenance compares: what a request's prompt says (token ids decoded with the model's tokenizer) and what
an answer says. Pure functions: the checker runs them on its own thread."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import orjson

MAX_TEXT_CHARS = 1 << 16  # of each prompt or answer considered
# Where text lives in requests and answers (never keys such as "role" or ids).
_TEXT_KEYS = frozenset({"content", "text", "prompt", "reasoning_content", "arguments"})
# Where a prompt's token ids live in an engine body: /generate's input_ids, a completion's token-id prompt.
_ID_KEYS = ("input_ids", "prompt")

Decode = Callable[[list[int]], str]  # the model's tokenizer: token ids → text


def texts_in(document: Any) -> Iterator[str]:
    """The strings under text-bearing keys of a parsed request or answer, at any depth (iteratively: no recursion
    limit to hit)."""
    stack = [document]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in _TEXT_KEYS and isinstance(value, str):
                    yield value
                elif isinstance(value, (dict, list)):
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(item for item in node if isinstance(item, (dict, list)))


def prompt_texts(engine_body: bytes, decode: Decode) -> list[str]:
    """The text of a prompt as admitted: its strings, and its token ids as the model's tokenizer reads them (a
    token-id prompt is as much a tenant's text as a string one)."""
    body = orjson.loads(engine_body)
    texts = list(texts_in(body))
    for key in _ID_KEYS:
        ids = body.get(key)
        if isinstance(ids, list) and ids and isinstance(ids[0], int):  # admission checked them: ids in the vocabulary
            # Nearly every token is a character or more: this many ids cover what is considered of a text prompt.
            texts.append(decode(ids[:MAX_TEXT_CHARS]))
    return texts


def answer_text(body: bytes) -> str:
    """The text of an answer as sent: one JSON object, or server-sent events (the last /generate event is whole)."""
    if not body.startswith(b"data:"):
        try:
            return "\n".join(texts_in(orjson.loads(body)))
        except orjson.JSONDecodeError:  # cut off at the capture limit: its text is still checked, keys and all
            return body.decode("utf-8", "replace")
    parts: list[str] = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: {"):
            try:
                parts.extend(texts_in(orjson.loads(line[6:])))
            except orjson.JSONDecodeError:
                continue
    return "".join(parts)
