"""First-token plausibility: a first token sooner than the prompt could be prefilled means the prompt was likely
not prefilled at all (the incident's one-token placeholder). A pure judgement; the exchange acts on it."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.errors import GatewayError


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

    def judge(self, prompt_tokens: int, cached_tokens: int, ttft_s: float) -> Implausible | None:
        """None when the first token took at least as long as a real prefill of the uncached part could."""
        floor_s = self.floor_s(prompt_tokens, cached_tokens)
        if floor_s is None or ttft_s >= floor_s:
            return None
        return Implausible(self, prompt_tokens - cached_tokens, ttft_s, floor_s)


@dataclass(frozen=True, slots=True)
class Implausible:
    rule: TTFTPlausibility
    uncached_tokens: int
    ttft_s: float
    floor_s: float

    def error(self) -> GatewayError:
        """What the client hears under `strict`: nothing of the answer was released."""
        return GatewayError(502, f"the decode engine's first token came {self.ttft_s * 1000:.0f} ms after dispatch, "
                                 f"sooner than a prefill of {self.uncached_tokens} uncached tokens can take "
                                 f"({self.floor_s * 1000:.0f} ms at most {self.rule.max_prefill_tokens_per_s:g} "
                                 "tokens/s); nothing was released", code="implausible_ttft")
