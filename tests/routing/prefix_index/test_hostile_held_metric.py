"""Hostile review: the unauthenticated /metrics published kvgate_cache_index_blocks{view="held"}, the count of
DISTINCT namespace-blind blocks the engine reports: A sends SECRET and reads whether the count grew — it does not
when another tenant's copy of SECRET is already held (one published hash for both namespaces)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from gateway.telemetry.metrics import _KvEventsCollector
from routing.prefix_index import CacheIndex, CacheMode
from routing.prefix_index.subscriber import SubscriberStats
from tests.routing.prefix_index.test_cache_aware import prompt, sglang_page_hashes

SECRET = list(range(200, 520))
OTHER = list(range(9000, 9320))


def _published_after_a(b_sent: bool) -> list[Any]:
    index = CacheIndex(page_size=16, capacity_tokens=100_000)
    rank = index.engine_view()
    index.mode = CacheMode.EXACT
    b_ids = SECRET if b_sent else OTHER
    index.record(prompt(b_ids, "tenant-b"))
    rank.store(sglang_page_hashes(b_ids, 16), None, b_ids, 16)
    index.record(prompt(SECRET, "tenant-a"))
    rank.store(sglang_page_hashes(SECRET, 16), None, SECRET, 16)  # A's own copy: the same published hashes
    subscriber = SimpleNamespace(index=index, mode=CacheMode.EXACT, stats=SubscriberStats())
    worker = SimpleNamespace(url="http://p0")
    families = _KvEventsCollector(lambda: [("m", worker, subscriber)]).collect()  # type: ignore[arg-type,list-item]
    return [sample for family in families for sample in family.samples]


def test_the_published_block_counts_do_not_read_whether_b_sent_as_prompt() -> None:
    seen = {b_sent: _published_after_a(b_sent) for b_sent in (False, True)}
    assert seen[True] == seen[False], "the unauthenticated /metrics reads B's prompts"
