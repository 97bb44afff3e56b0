"""Output provenance, sampled: does an answer share a long stretch of text with what *another* tenant recently sent?
The incident's leaking answers were fluent text built on someone else's context; status codes and counts saw
nothing.

For a sampled request the gateway first adds its own prompt's character n-grams (after lower-casing and dropping
everything but letters and digits) to a bounded window, tagged with its tenant, then checks its answer's n-grams
against the window. Only an n-gram that exactly one tenant sent, and not the answering one, is evidence: text two
tenants sent is common, so no tenant can make another's answer look foreign by sending likely answer text (the
answering tenant's own prompt is already in the window when its answer is checked). Answers are not remembered: two
tenants asking alike may well get alike answers (greedy decoding, common facts), while another tenant's prompt text
in an answer is the leak's signature. Only hashes are kept — Python's string hash, salted per process, so they cannot
be looked up elsewhere — never the text.

A prompt's n-grams are kept by winnowing (Schleimer, Wilkerson and Aiken, SIGMOD 2003: the smallest hash of every
`WINDOW` consecutive n-grams, about 2 in `WINDOW + 1`), and answers are checked at every position, so any stretch of
`NGRAM + WINDOW - 1` letters and digits an answer shares with one other tenant's prompt is found, wherever it stands
in either. A prompt marks common every remembered n-gram of another tenant's that it holds at any position, so text
two tenants sent is common whatever its offset in each.
"""

from __future__ import annotations

import logging
import random
import re
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

from gateway.integrity.provenance_text import MAX_TEXT_CHARS, Decode, answer_text, prompt_texts
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.record import RequestRecord

log = logging.getLogger("kvgate")

NGRAM = 48  # characters: long enough that shared boilerplate ("you are a helpful assistant") rarely reaches it
WINDOW = 15  # n-grams per winnowing window: one kept in every WINDOW at least, about one in 8 on average
_MAX_BODY = 1 << 20  # bytes of an engine body parsed for its prompt
_NOT_WORD = re.compile(r"[\W_]+")


def normalized(text: str) -> str:
    return _NOT_WORD.sub("", text[:MAX_TEXT_CHARS].lower())


def _grams(text: str) -> Iterator[int]:
    """The hash of the n-gram at every position."""
    norm = normalized(text)
    for start in range(max(0, len(norm) - NGRAM + 1)):
        yield hash(norm[start:start + NGRAM])


def winnowed(grams: list[int]) -> set[int]:
    """The smallest hash of every `WINDOW` consecutive n-grams (of all of them when there are fewer): any `WINDOW`
    n-grams in a row that two texts share give both the same kept n-gram."""
    if len(grams) < WINDOW:
        return {min(grams)} if grams else set()
    kept: set[int] = set()
    smallest: deque[int] = deque()  # positions in the current window whose hashes increase: the first is its minimum
    for at, gram in enumerate(grams):
        while smallest and grams[smallest[-1]] >= gram:
            smallest.pop()
        smallest.append(at)
        if smallest[0] <= at - WINDOW:
            smallest.popleft()
        if at >= WINDOW - 1:
            kept.add(grams[smallest[0]])
    return kept


class ProvenanceWindow:
    """Recent kept n-gram hashes of sampled prompts, each with the one tenant that sent it, or None once a second
    tenant sent it too (common stays common while it is remembered). Bounded: when full, the oldest n-gram of
    whoever holds the most goes first, so no tenant can push another's prompts out by sending many of its own."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._owners: dict[int, str | None] = {}
        self._held: dict[str | None, OrderedDict[int, None]] = {}  # owner (None: common) → its n-grams, oldest first

    @property
    def capacity(self) -> int:
        return self._capacity

    def remember(self, tenant: str, texts: Iterable[str]) -> None:
        owners = self._owners
        for text in texts:
            grams = list(_grams(text))
            for gram in grams:  # another tenant's n-gram this prompt holds anywhere: common from now on
                owner = owners.get(gram, tenant)
                if owner is not None and owner != tenant:
                    self._move(gram, owner, None)
            for gram in winnowed(grams):
                if gram not in owners:
                    owners[gram] = tenant
                    self._held.setdefault(tenant, OrderedDict())[gram] = None
                else:
                    self._held[owners[gram]].move_to_end(gram)
        while len(owners) > self._capacity:
            largest = max(self._held, key=lambda who: len(self._held[who]))
            gram, _ = self._held[largest].popitem(last=False)
            del owners[gram]
            if not self._held[largest]:
                del self._held[largest]

    def _move(self, gram: int, owner: str | None, to: str | None) -> None:
        held = self._held[owner]
        del held[gram]
        if not held:
            del self._held[owner]
        self._owners[gram] = to
        self._held.setdefault(to, OrderedDict())[gram] = None

    def foreign(self, tenant: str, text: str) -> bool:
        """Whether `text` carries an n-gram that one other tenant, and nobody else, sent."""
        owners = self._owners
        return any((owner := owners.get(gram)) is not None and owner != tenant for gram in _grams(text))


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

    def submit(self, model: str, window_size: int, record: RequestRecord, decode: Decode) -> None:
        """`decode`: the model's tokenizer, for token-id prompts (run on the checker's thread, like the hashing)."""
        self._thread.submit(self._check_safely, model, window_size, record, decode)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    def _check_safely(self, model: str, window_size: int, record: RequestRecord, decode: Decode) -> None:
        try:
            self._check(model, window_size, record, decode)
        except Exception:  # a check must never take anything else down
            log.exception("provenance check failed for request_id=%s", record.request_id)

    def _check(self, model: str, window_size: int, record: RequestRecord, decode: Decode) -> None:
        """This request's prompt joins the window; then, does its answer share a long stretch with what another
        tenant, and only that one, recently sent? Counted and logged (never the text)."""
        window = self.windows.get(model)
        if window is None:
            window = self.windows[model] = ProvenanceWindow(window_size)
        admitted = record.admitted
        if admitted is not None and len(admitted.engine_body) <= _MAX_BODY:
            # Its own prompt first: text the answering tenant sent itself is never evidence against another tenant
            # (an echo, a quote, a refusal it asked to be repeated), however many sent it before.
            window.remember(record.tenant, prompt_texts(admitted.engine_body, decode))
        answer = answer_text(bytes(record.answer))
        self._metrics.provenance_checks.labels(model).inc()
        if window.foreign(record.tenant, answer):
            self._metrics.provenance_foreign.labels(model).inc()
            exchange = record.exchange
            log.error("answer carries text only another tenant recently sent: request_id=%s rid=%s model=%s "
                      "prefill=%s decode=%s", record.request_id, exchange.rid if exchange else None, model,
                      exchange.pair.prefill.url if exchange else None, exchange.pair.decode.url if exchange else None)
