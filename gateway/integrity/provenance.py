"""Output provenance, sampled: does an answer share a long stretch of text with what *another* tenant recently sent?
The incident's leaking answers were fluent text built on someone else's context; status codes and counts saw
nothing.

For a sampled request the gateway checks its answer's character n-grams (after lower-casing and dropping everything
but letters and digits) against a bounded window of other tenants' prompt n-grams, then adds its own prompt's,
tagged with the tenant. Answers are not remembered: two tenants asking alike may well get alike answers (greedy
decoding, common facts), while another tenant's prompt text in an answer is the leak's signature. Only hashes are kept
— Python's string hash, salted per process, so they cannot be looked up elsewhere — never the text. Stored n-grams are
taken every `STRIDE` characters and checked at every position, so any shared stretch of `NGRAM + STRIDE` characters is
found.
"""

from __future__ import annotations

import logging
import random
import re
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson

from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.record import RequestRecord

log = logging.getLogger("kvgate")

NGRAM = 48  # characters: long enough that shared boilerplate ("you are a helpful assistant") rarely reaches it
STRIDE = 8
MAX_TEXT_CHARS = 1 << 16  # of each prompt or answer considered
_NOT_WORD = re.compile(r"[\W_]+")
# Where text lives in requests and answers (never keys such as "role" or ids).
_TEXT_KEYS = frozenset({"content", "text", "prompt", "reasoning_content", "arguments"})


def normalized(text: str) -> str:
    return _NOT_WORD.sub("", text[:MAX_TEXT_CHARS].lower())


def _grams(text: str, step: int) -> Iterator[int]:
    norm = normalized(text)
    for start in range(0, max(0, len(norm) - NGRAM + 1), step):
        yield hash(norm[start:start + NGRAM])


def texts_in(document: Any) -> Iterator[str]:
    """The strings under text-bearing keys of a parsed request or answer, at any depth (iteratively: no recursion
    limit to hit)."""
    stack = [document]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in _TEXT_KEYS and isinstance(value, str):
                    yield value
                elif isinstance(value, (dict, list)):
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(item for item in node if isinstance(item, (dict, list)))


def answer_text(body: bytes) -> str:
    """The text of an answer as sent: one JSON object, or server-sent events (the last /generate event is whole)."""
    if not body.startswith(b"data:"):
        try:
            return "\n".join(texts_in(orjson.loads(body)))
        except orjson.JSONDecodeError:  # cut off at the capture limit: its text is still checked, keys and all
            return body.decode("utf-8", "replace")
    parts: list[str] = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: {"):
            try:
                parts.extend(texts_in(orjson.loads(line[6:])))
            except orjson.JSONDecodeError:
                continue
    return "".join(parts)


_SHARED = ""  # an n-gram more than one tenant sent: common text, nobody's secret


class ProvenanceWindow:
    """Recent n-gram hashes of sampled prompts, each with the one tenant that sent it (bounded, LRU). An n-gram two
    tenants sent is nobody's: one tenant cannot make another's answers look foreign by sending likely answer text."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._owners: OrderedDict[int, str] = OrderedDict()

    @property
    def capacity(self) -> int:
        return self._capacity

    def remember(self, tenant: str, texts: Iterable[str]) -> None:
        owners = self._owners
        for text in texts:
            for gram in _grams(text, STRIDE):
                owner = owners.get(gram)
                owners[gram] = tenant if owner is None or owner == tenant else _SHARED
                owners.move_to_end(gram)
        while len(owners) > self._capacity:
            owners.popitem(last=False)

    def foreign(self, tenant: str, text: str) -> bool:
        """Whether `text` shares an n-gram with another tenant's remembered text."""
        owners = self._owners
        return any((owner := owners.get(gram)) and owner != tenant for gram in _grams(text, 1))


class ProvenanceChecker:
    """Sampled answers checked against a window per model, on one thread of its own: hashing a long prompt or answer
    takes tens of ms, kept off the event loop (one thread, so the windows need no lock)."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.windows: dict[str, ProvenanceWindow] = {}
        self._metrics = metrics
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvgate-provenance")

    @staticmethod
    def samples(rate: float) -> bool:
        return rate > 0 and random.random() < rate

    def submit(self, model: str, window_size: int, record: RequestRecord) -> None:
        self._thread.submit(self._check_safely, model, window_size, record)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    def _check_safely(self, model: str, window_size: int, record: RequestRecord) -> None:
        try:
            self._check(model, window_size, record)
        except Exception:  # a check must never take anything else down
            log.exception("provenance check failed for request_id=%s", record.request_id)

    def _check(self, model: str, window_size: int, record: RequestRecord) -> None:
        """Does the answer share a long stretch with what another tenant recently sent? Counted and logged (never the
        text); then this request's prompt joins the window."""
        window = self.windows.get(model)
        if window is None:
            window = self.windows[model] = ProvenanceWindow(window_size)
        answer = answer_text(bytes(record.answer))
        self._metrics.provenance_checks.labels(model).inc()
        if window.foreign(record.tenant, answer):
            self._metrics.provenance_foreign.labels(model).inc()
            exchange = record.exchange
            log.error("answer shares text with another tenant's recent traffic: request_id=%s rid=%s model=%s "
                      "prefill=%s decode=%s", record.request_id, exchange.rid if exchange else None, model,
                      exchange.pair.prefill.url if exchange else None, exchange.pair.decode.url if exchange else None)
        admitted = record.admitted
        if admitted is not None and len(admitted.engine_body) <= 1 << 20:
            # Prompts only: two tenants asking alike may get alike answers (greedy decoding, common facts), but an
            # answer carrying someone else's prompt text is the leak's signature.
            window.remember(record.tenant, texts_in(orjson.loads(admitted.engine_body)))
