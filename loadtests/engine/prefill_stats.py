"""What a prefill's load reports count of its forward steps (one request per step in the emulator)."""

from __future__ import annotations


class PrefillStats:
    __slots__ = ("busy_us", "cache_hit_rate", "uncached_tokens")

    def __init__(self) -> None:
        self.uncached_tokens = 0  # 0.5.22+ total_prefill_uncached_tokens (`batch.extend_num_tokens`, summed)
        self.busy_us = 0  # 0.5.22+ total_prefill_busy_us: forward time, summed
        self.cache_hit_rate = 0.0  # the last step's hit tokens / input tokens (`log_prefill_stats`)

    def step(self, tokens: int, cached: int, busy_s: float) -> None:
        self.uncached_tokens += tokens - cached
        self.busy_us += int(busy_s * 1e6)
        self.cache_hit_rate = cached / tokens if tokens else 0.0
