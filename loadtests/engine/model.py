"""Deterministic toy model: it 'attends' over the KV slots a request holds and echoes the token ids stored there.

Output token i is the id stored at prompt position i (mod the prompt length); the first token is sampled by the
prefill from its own KV. A request whose prompt KV was written correctly therefore echoes its own prompt, and one
that attends over pages the handoff never wrote echoes whatever an earlier request left in them.
"""

from __future__ import annotations

from .kvpool import KVPool


def first_token(pool: KVPool, prompt_positions: list[int]) -> int:
    return pool.slots[prompt_positions[0]]


def generate(pool: KVPool, prompt_positions: list[int], first: int, max_new: int) -> list[int]:
    if max_new <= 0:
        return []
    slots, n = pool.slots, len(prompt_positions)
    return [first] + [slots[prompt_positions[i % n]] for i in range(1, max_new)]
