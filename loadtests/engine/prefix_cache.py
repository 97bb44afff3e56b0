"""A small stand-in for SGLang's radix cache: prompts are cached per namespace, the request's `extra_key` (the
OpenAI routes fold `cache_salt` in front of it: serving_base._compute_extra_key in 0.5.8), in pages of 64 tokens,
and a request reports as `cached_tokens` the pages it shares with earlier prompts of the same namespace. Enough to
show whether two tenants' requests could share KV pages; not a model of eviction."""

from __future__ import annotations

from typing import Any

PAGE = 64
_PAGES_KEPT = 200_000  # forgotten all at once beyond this (the emulator must stay small)


def namespace(body: dict[str, Any]) -> str:
    parts = [body.get(key) for key in ("cache_salt", "extra_key")]
    return "".join(part for part in parts if isinstance(part, str))


class PrefixCache:
    def __init__(self) -> None:
        self._pages: set[int] = set()  # chained hashes: a page's hash covers every token before it too

    def match_and_insert(self, space: str, ids: list[int]) -> int:
        chain = hash(space)
        cached, matching = 0, True
        # SGLang never serves the whole prompt from cache: the last token is always computed.
        for start in range(0, len(ids) - 1 - (len(ids) - 1) % PAGE, PAGE):
            chain = hash((chain, tuple(ids[start:start + PAGE])))
            if matching and chain in self._pages:
                cached += PAGE
            else:
                matching = False
                self._pages.add(chain)
        if len(self._pages) > _PAGES_KEPT:
            self._pages.clear()
        return cached
