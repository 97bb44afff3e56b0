"""The exchange's state chart as types: each half moves forward only, along its legal transitions."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class _Singletons(enum.Enum):
    """Members hashed by identity (they are singletons), in C: Enum's own __hash__ runs Python code, and the state
    chart hashes members at every move."""

    __hash__ = object.__hash__


class Phase(_Singletons):
    CONNECTING = "connecting"  # taking a verified connection to each half: nothing reached either engine
    SENT = "sent"  # both requests sent, with the same rid and bootstrap room
    CLOSED = "closed"  # both halves closed, every abort sent


class Prefill(_Singletons):
    PENDING = "pending"  # its fate unknown: it may still write into decode's KV pages
    SETTLED = "settled"  # it answered (any status), or its abort has answered
    OK = "ok"  # it answered 2xx with a clean body, its count verified


class Decode(_Singletons):
    PENDING = "pending"
    STREAMING = "streaming"  # its first token is in
    SAID_DONE = "said_done"  # it sent [DONE]: nothing may follow
    FINISHED = "finished"  # its stream ended after [DONE] and passed every end-of-stream check


_LEGAL: dict[enum.Enum, frozenset[enum.Enum]] = {
    Phase.CONNECTING: frozenset({Phase.SENT, Phase.CLOSED}),
    Phase.SENT: frozenset({Phase.CLOSED}),
    Prefill.PENDING: frozenset({Prefill.SETTLED}),
    Prefill.SETTLED: frozenset({Prefill.OK}),
    Decode.PENDING: frozenset({Decode.STREAMING, Decode.SAID_DONE}),  # [DONE] before any token: a broken stream
    Decode.STREAMING: frozenset({Decode.SAID_DONE}),
    Decode.SAID_DONE: frozenset({Decode.FINISHED}),
}


class IllegalTransition(Exception):
    pass


@dataclass(slots=True)
class ExchangeState:
    phase: Phase = Phase.CONNECTING
    prefill: Prefill = Prefill.PENDING
    decode: Decode = Decode.PENDING
    decode_counted: bool = False  # decode reported its prompt count (checked) at least once

    def move(self, to: Phase | Prefill | Decode) -> None:
        field = "phase" if isinstance(to, Phase) else "prefill" if isinstance(to, Prefill) else "decode"
        current = getattr(self, field)
        if to not in _LEGAL.get(current, frozenset()):
            raise IllegalTransition(f"{field}: {current.value} → {to.value}")
        setattr(self, field, to)

    @property
    def sent(self) -> bool:
        return self.phase is not Phase.CONNECTING

    @property
    def prefill_settled(self) -> bool:
        return self.prefill is not Prefill.PENDING

    @property
    def prefill_ok(self) -> bool:
        return self.prefill is Prefill.OK

    @property
    def decode_finished(self) -> bool:
        return self.decode is Decode.FINISHED
