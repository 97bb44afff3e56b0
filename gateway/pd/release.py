"""Verify, then release: decode's events are held until prefill has answered and every count reported so far is
verified (with `release: verified`), then released in order; `Done` once the whole answer is checked."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.pd.events import Done, RelayQueue
from gateway.pd.plan import ExchangePlan
from gateway.pd.states import ExchangeState
from routing.engines.answers import INPUT_LOGPROBS


class VerifiedRelease:
    def __init__(self, events: RelayQueue, plan: ExchangePlan, state: ExchangeState) -> None:
        self._events = events
        self._state = state
        self._waits_for_prefill = plan.waits_for_prefill
        self._verified = plan.release_verified
        self._held: list[bytes] = []
        self._released = False
        self._done = False
        # /generate with return_logprob: only the prefill has the prompt's logprobs; they are prepended to every
        # decode event's, as SGLang's router does (merge_logprobs_in_json), so decode waits for prefill's answer.
        self.prompt_logprobs: list[Any] | None = None
        self._prompt_logprobs_json: bytes | None = None

    def offer(self, payload: bytes) -> bool:
        """A checked decode event: out at once once released, else held (True: the caller may `advance`)."""
        if self._released:
            self._events.put_nowait(self._merged(payload))
            return False
        self._held.append(payload)
        return True

    def take_prompt_logprobs(self, prefill_answer: dict[str, Any]) -> None:
        meta = prefill_answer.get("meta_info")
        logprobs = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
        self.prompt_logprobs = logprobs if isinstance(logprobs, list) else []

    def drop(self) -> None:
        """The exchange failed: nothing held may ever go out."""
        self._held.clear()

    def advance(self) -> None:
        """Release what may go out now, and `Done` once decode finished and prefill answered (the caller checks that
        the exchange has neither failed nor lost its client)."""
        state = self._state
        if not self._released and (not self._waits_for_prefill
                                   or (state.prefill_ok and (state.decode_counted or not self._verified))):
            self._released = True
            for payload in self._held:
                self._events.put_nowait(self._merged(payload))
            self._held.clear()
        if self._released and state.decode_finished and state.prefill_ok and not self._done:
            self._done = True
            self._events.put_nowait(Done())

    def _merged(self, payload: bytes) -> bytes:
        """A decode event with the prefill's prompt logprobs in front of its own (only when asked for). The prompt's
        list is encoded once and spliced in: every streamed event carries it, and it may be long."""
        if self.prompt_logprobs is None:
            return payload
        if self._prompt_logprobs_json is None:
            self._prompt_logprobs_json = orjson.dumps(self.prompt_logprobs)[1:-1]
        found = INPUT_LOGPROBS.search(payload)
        if found is None or not self._prompt_logprobs_json:
            return payload  # the engine sent no list to extend (or there is nothing to add)
        at = found.end()
        glue = b"" if payload[at:at + 1] == b"]" else b","
        return payload[:at] + self._prompt_logprobs_json + glue + payload[at:]
