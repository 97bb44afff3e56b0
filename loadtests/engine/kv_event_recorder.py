"""The radix cache's KV event queue, as each SGLang release fills it (the cache calls `stored`/`removed`/`cleared`;
the scheduler step `take`s the queue into one batch).

* before 0.5.22 (0.5.8's `RadixCache._record_store_event` / `_record_remove_event`): one `BlockStored` per page
  (`block_hashes=[h]`, `parent_block_hash` = the previous page's hash, None under the root), one `BlockRemoved`
  per evicted page.
* 0.5.22 and later (`mem_cache/events.py: KVCacheEventRecorder`): `enqueue` folds an event into the queue's tail
  when it continues it - a `BlockStored` whose parent is the tail's last hash (same medium, lora, block size, salt,
  session), or any `BlockRemoved` after a `BlockRemoved` of the same medium - so a new radix node is one
  `BlockStored` holding all its pages, and consecutive evictions are one `BlockRemoved`.
"""

from __future__ import annotations

import time
from array import array
from typing import Any

from .dialect import Dialect
from .kv_event_wire import (
    GPU,
    AllBlocksCleared0522,
    AllBlocksCleared058,
    BlockRemoved0522,
    BlockRemoved058,
    BlockStored0522,
    BlockStored058,
    KVEventBatch0522,
    KVEventBatch058,
)


class Recorder058:
    def __init__(self) -> None:
        self._queue: list[Any] = []

    def stored(self, hashes: array, parent: int | None, tokens: list[int], page_size: int) -> None:
        append = self._queue.append
        for i, block_hash in enumerate(hashes):
            page = tokens[i * page_size:(i + 1) * page_size]
            append(BlockStored058(block_hashes=[block_hash], parent_block_hash=parent, token_ids=page,
                                  block_size=len(page), lora_id=None))
            parent = block_hash

    def removed(self, hashes: array) -> None:
        self._queue.extend(BlockRemoved058(block_hashes=[h]) for h in hashes)

    def cleared(self) -> None:
        self._queue.append(AllBlocksCleared058())

    def take(self) -> list[Any]:
        events, self._queue = self._queue, []
        return events

    def batch(self, events: list[Any]) -> Any:
        """`KVEventBatch(ts=time.time(), events=events)`, its rank set by `ZmqEventPublisher.publish`."""
        return KVEventBatch058(ts=time.time(), events=events, attn_dp_rank=0)


class Recorder0522:
    def __init__(self) -> None:
        self._queue: list[Any] = []

    def _enqueue(self, event: Any) -> None:
        if self._queue:
            tail = self._queue[-1]
            if isinstance(tail, BlockRemoved0522) and isinstance(event, BlockRemoved0522):
                if tail.medium == event.medium:
                    tail.block_hashes.extend(event.block_hashes)
                    return
            elif isinstance(tail, BlockStored0522) and isinstance(event, BlockStored0522):
                if (tail.medium == event.medium and tail.lora_id == event.lora_id
                        and tail.block_size == event.block_size and tail.cache_salt == event.cache_salt
                        and tail.session_id == event.session_id and tail.lora_name == event.lora_name
                        and tail.block_hashes and event.parent_block_hash == tail.block_hashes[-1]):
                    tail.block_hashes.extend(event.block_hashes)
                    tail.token_ids.extend(event.token_ids)
                    return
        self._queue.append(event)

    def stored(self, hashes: array, parent: int | None, tokens: list[int], page_size: int) -> None:
        # the per-page events of one node chain into each other, so they fold into one: build it whole
        self._enqueue(BlockStored0522(block_hashes=hashes.tolist(), parent_block_hash=parent, token_ids=list(tokens),
                                      block_size=page_size, lora_id=None, medium=GPU))

    def removed(self, hashes: array) -> None:
        if len(hashes):
            self._enqueue(BlockRemoved0522(block_hashes=hashes.tolist(), medium=GPU))

    def cleared(self) -> None:
        self._enqueue(AllBlocksCleared0522())

    def take(self) -> list[Any]:
        events, self._queue = self._queue, []
        return events

    def batch(self, events: list[Any]) -> Any:
        return KVEventBatch0522(ts=time.time(), events=events, attn_dp_rank=0)


def recorder_for(dialect: Dialect) -> Recorder058 | Recorder0522:
    return Recorder058() if dialect is Dialect.V0_5_8 else Recorder0522()
