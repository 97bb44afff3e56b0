"""First-token plausibility: a first token sooner than the prompt could be prefilled means the prompt was likely
not prefilled at all (the incident's one-token placeholder). A pure judgement; the exchange acts on it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TTFTPlausibility:
    """A model's ceiling on prefill speed: a first token sooner than prompt_tokens / max_prefill_tokens_per_s is not
    a real prefill (judged for prompts of at least `min_prompt_tokens`)."""

    max_prefill_tokens_per_s: float
    min_prompt_tokens: int = 1024
    strict: bool = False

    def floor_s(self, prompt_tokens: int, cached_tokens: int) -> float | None:
        """The least time a real prefill of the uncached part takes; None when the prompt is too short to judge."""
        uncached = prompt_tokens - cached_tokens
        if uncached < self.min_prompt_tokens:
            return None
        return uncached / self.max_prefill_tokens_per_s
