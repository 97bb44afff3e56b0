"""Verify, then release: decode's events are held until prefill has answered and every count reported so far is
verified (with `release: verified`), then released in order; `Done` once the whole answer is checked."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.pd.events import Done, RelayQueue
from gateway.pd.plan import ExchangePlan
from gateway.pd.states import ExchangeState
from routing.engines.answers import INPUT_LOGPROBS
from routing.engines.errors import EngineBroken


class VerifiedRelease:
    def __init__(self, events: RelayQueue, plan: ExchangePlan, state: ExchangeState) -> None:
        self._events = events
        self._state = state
        self._waits_for_prefill = plan.waits_for_prefill
        self._verified = plan.release_verified
        self._stream = plan.admitted.stream
        self._held: list[bytes] = []
        self._released = False
        self._done = False
        self.released_bytes = 0  # decode payload bytes handed to the relay, prompt logprobs included
        # /generate with return_logprob: only the prefill has the prompt's logprobs; they are prepended to decode's
        # own list (SGLang's router: merge_logprobs_in_json), so decode waits for prefill's answer. Once: in a
        # stream's first event that has the list (SGLang's scheduler, too, sends them once: input_logprob_sent), or
        # in a whole answer's last event (what the relay answers). Never into every cumulative event: a long
        # prompt's list spliced into each of them multiplied the output by the number of events.
        self.prompt_logprobs: list[Any] | None = None
        self._prompt_logprobs_merged = False
        self._last: bytes | None = None  # a whole answer's latest event, held back to carry the prompt's logprobs

    def offer(self, payload: bytes) -> bool:
        """A checked decode event: out at once once released, else held (True: the caller may `advance`)."""
        if self._released:
            if self.prompt_logprobs is None:  # the common case, without `_out`'s branches
                self._put(payload)
            else:
                self._out(payload)
            return False
        self._held.append(payload)
        return True

    def take_prompt_logprobs(self, prefill_answer: dict[str, Any]) -> None:
        """Prefill's prompt logprobs, to splice into decode's answer after that was checked: so only SGLang's shape
        is taken, entries of [logprob, token id, text] (scalars), never an object (a prompt count nobody verified)."""
        meta = prefill_answer.get("meta_info")
        logprobs = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
        if not isinstance(logprobs, list):
            self.prompt_logprobs = []
            return
        for entry in logprobs:
            if not isinstance(entry, list) or not all(item is None or isinstance(item, (int, float, str))
                                                      for item in entry):
                raise EngineBroken("prefill", "prefill's input_token_logprobs are not [logprob, token id, text] "
                                   "entries")
        self.prompt_logprobs = logprobs

    def drop(self) -> None:
        """The exchange failed: nothing held may ever go out."""
        self._held.clear()
        self._last = None

    def advance(self) -> None:
        """Release what may go out now, and `Done` once decode finished and prefill answered (the caller checks that
        the exchange has neither failed nor lost its client)."""
        state = self._state
        if not self._released and (not self._waits_for_prefill
                                   or (state.prefill_ok and (state.decode_counted or not self._verified))):
            self._released = True
            for payload in self._held:
                self._out(payload)
            self._held.clear()
        if self._released and state.decode_finished and state.prefill_ok and not self._done:
            self._done = True
            if self._last is not None:
                self._put(self._merge_once(self._last))
                self._last = None
            self._events.put_nowait(Done())

    def _out(self, payload: bytes) -> None:
        if self.prompt_logprobs is None or self._prompt_logprobs_merged:
            self._put(payload)
        elif self._stream:
            self._put(self._merge_once(payload))
        else:  # the relay answers with the last event: the one before it goes out as it is
            if self._last is not None:
                self._put(self._last)
            self._last = payload

    def _put(self, payload: bytes) -> None:
        self.released_bytes += len(payload)
        self._events.put_nowait(payload)

    def _merge_once(self, payload: bytes) -> bytes:
        """The event with the prefill's prompt logprobs in front of its own list, if it has one (then no later
        event gets them)."""
        found = INPUT_LOGPROBS.search(payload)
        if found is None or self.prompt_logprobs is None:
            return payload  # the engine sent no list to extend: the next event may
        self._prompt_logprobs_merged = True
        if not self.prompt_logprobs:
            return payload
        at = found.end()
        glue = b"" if payload[at:at + 1] == b"]" else b","
        return payload[:at] + orjson.dumps(self.prompt_logprobs)[1:-1] + glue + payload[at:]
