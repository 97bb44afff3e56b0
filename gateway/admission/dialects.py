"""SGLang versions that turn the same chat request into different prompts.

kvgate renders a chat once per dialect present among a model's workers and checks each engine's own count against
the rendering for that engine's version (the KV-pool gate reads the version from `/server_info`).
"""

from __future__ import annotations

import enum
import functools
import re


class Dialect(enum.Enum):
    """What a version does with a chat request; see `gateway.admission.chat` for the differences."""

    __hash__ = object.__hash__  # a singleton: hashed by identity, in C (each request's counts are keyed by it)

    V0_5_8 = "0.5.8"     # everything before 0.5.22: transformers 4.57 tokenize=True, reasoning_effort defaults
    V0_5_22 = "0.5.22"   # Tool.model_dump() shape, object-only tool arguments, tool text parts joined
    V0_5_23 = "0.5.23"   # and later: tool functions keep the client's key order, `strict` only when sent


@functools.lru_cache(maxsize=64)
def dialect_for(version: str) -> Dialect:
    parts = tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])
    if parts >= (0, 5, 23):
        return Dialect.V0_5_23
    if parts >= (0, 5, 22):
        return Dialect.V0_5_22
    return Dialect.V0_5_8
