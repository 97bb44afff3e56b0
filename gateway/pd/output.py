"""Decode's output as it streams: counted per event and in tokens as decode reports them, and charged to the
tenant's pass, which the exchange owns once dispatched and gives back, with the whole output, when it closes."""

from __future__ import annotations

from gateway.pd.ports import TenantHold
from routing.engines.answers import COMPLETION_TOKENS

_OUTPUT_STEP = 64  # output tokens between two charges of the tenant's output budget (charged as it streams)


class OutputMeter:
    __slots__ = ("_charged", "_pass", "_reported", "events", "tokens")

    def __init__(self, hold: TenantHold | None, *, reserve: int = 0) -> None:
        self._pass = hold
        self._charged = hold if hold is not None and hold.charges_output else None
        self.events = 0  # decode events relayed or held (about one per output token when streaming)
        self.tokens = 0  # as decode reports them (completion_tokens), cumulative
        self._reported = 0
        if self._charged is not None and reserve:  # charged now, up to `reserve` tokens; settled at close
            self._charged.output_so_far(reserve)
            self._reported = reserve

    def observe(self, event: bytes) -> None:
        self.events += 1
        hold = self._charged
        if hold is None:
            return
        match = COMPLETION_TOKENS.search(event)
        tokens = int(match[1]) if match is not None else self.tokens + 1
        if tokens > self.tokens:
            self.tokens = tokens
            if tokens - self._reported >= _OUTPUT_STEP:
                self._reported = tokens
                hold.output_so_far(tokens)

    def close(self) -> None:
        """Give the tenant's pass back, charged with the whole output (what was charged beyond it, given back)."""
        if self._pass is not None:
            self._pass.release(output_tokens=self.tokens or self.events)
            self._pass = None
