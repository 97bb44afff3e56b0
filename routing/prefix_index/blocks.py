"""A prompt's token ids as chained block keys: the key of block i covers every token before it too, so equal keys
mean equal prefixes, which is what a radix cache can reuse.

Blocks are whole engine pages (SGLang caches only page-aligned prefixes) of at least MIN_BLOCK_TOKENS tokens: a key
per token (SGLang's default page size is 1) would cost a hash per token per request and far more index memory, for
a prediction at most one block finer. Keys are Python's hash of (previous key, the block's bytes): one C call per
block, the same within a process, which is all one gateway replica's index needs (each replica keeps its own).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from routing.stable_hash import stable_hash

MIN_BLOCK_TOKENS = 32
_ID_BYTES = 4  # token ids as unsigned 32-bit little-endian: one format for prompts and KV events


def block_tokens_for(page_size: int) -> int:
    """The smallest multiple of the engine's page size of at least MIN_BLOCK_TOKENS tokens."""
    page = max(1, page_size)
    return page * -(-MIN_BLOCK_TOKENS // page)


def ids_to_bytes(ids: Sequence[int]) -> bytes:
    return array("I", ids).tobytes()


def chain_keys(ids: bytes, block_tokens: int, seed: int, *, blocks: int) -> list[int]:
    """The keys of the first `blocks` blocks of `ids`, chained from `seed`."""
    step = block_tokens * _ID_BYTES
    keys: list[int] = []
    key = seed
    append = keys.append
    for start in range(0, blocks * step, step):
        key = hash((key, ids[start:start + step]))
        append(key)
    return keys


def namespace_seed(namespace: str) -> int:
    """Where a tenant's chain starts: two namespaces' equal prompts share no key (SGLang keeps their pages apart)."""
    return stable_hash(b"kvgate-prefix-namespace", namespace.encode())


BLIND_SEED = 0  # the chain of KV events: SGLang's published block hashes do not depend on the namespace


class PromptTokens:
    """One request's prompt as routing sees it: its leading token ids, its exact length and its namespace. Keys are
    computed once per block size and kept, so a retry on another pair costs nothing more."""

    __slots__ = ("_keys", "_whole", "ids", "max_new_tokens", "namespace", "predicted_cached", "tokens")

    def __init__(self, ids: bytes, *, tokens: int, namespace: str, max_new_tokens: int = 0) -> None:
        """`ids`: the prompt's first token ids as `ids_to_bytes` gives them (all of them, or a window of at least
        the routing limit); `tokens`: the whole prompt's exact count."""
        self.ids = ids
        self.tokens = tokens
        self.namespace = namespace
        self.max_new_tokens = max_new_tokens
        self.predicted_cached = 0  # tokens the picked prefill is expected to hold (set by the cache-aware pick)
        self._whole = len(ids) // _ID_BYTES >= tokens
        self._keys: dict[tuple[int, bool], list[int]] = {}

    def cacheable_blocks(self, block_tokens: int) -> int:
        """Whole blocks an engine could serve from cache: SGLang always computes the prompt's last token."""
        held = len(self.ids) // _ID_BYTES
        usable = min(held, self.tokens - 1) if self._whole else held
        return max(0, usable) // block_tokens

    def stored_blocks(self, block_tokens: int) -> int:
        """Whole blocks the engine caches once it has prefilled the prompt: all of them (SGLang's prefill inserts
        the whole prompt, its last token's KV included), so a prompt of a whole number of blocks leaves one more
        than a later request can hit."""
        held = len(self.ids) // _ID_BYTES
        return (min(held, self.tokens) if self._whole else held) // block_tokens

    def keys(self, block_tokens: int, *, namespaced: bool = True, stored: bool = False) -> list[int]:
        """Chained keys of the cacheable blocks (`stored`: of the blocks the engine will hold); `namespaced=False`
        gives the namespace-blind chain of KV events."""
        cached = self._keys.get((block_tokens, namespaced))
        if cached is None:
            seed = namespace_seed(self.namespace) if namespaced else BLIND_SEED
            cached = chain_keys(self.ids, block_tokens, seed, blocks=self.stored_blocks(block_tokens))
            self._keys[(block_tokens, namespaced)] = cached
        if stored:
            return cached
        cacheable = self.cacheable_blocks(block_tokens)
        return cached if cacheable == len(cached) else cached[:cacheable]
