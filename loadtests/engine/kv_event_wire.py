"""KV event payloads as SGLang's msgspec Structs encode them (`disaggregation/kv_events.py`), per release.

* 0.5.8 (every version before 0.5.22): events are positional arrays led by their tag
  (`array_like=True, tag=True, omit_defaults=True`): `["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id]`, `["BlockRemoved", block_hashes]`, `["AllBlocksCleared"]`.
* 0.5.22 and later (0.5.22 and 0.5.23 agree): events are tagged maps (`tag=True, omit_defaults=True`, no
  `array_like`): `{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h|null, "token_ids": [...],
  "block_size": n, "lora_id": null, "medium": "GPU"}`; fields with a `None` default (`cache_salt`, `session_id`,
  `lora_name`) are omitted when unset, the required ones (`parent_block_hash`, `lora_id`) are not.
  `{"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU"}`, `{"type": "AllBlocksCleared"}`.

Both wrap the events in `EventBatch`, an array `[ts, events, attn_dp_rank]` (0.5.8 with `omit_defaults`, which keeps
the rank the publisher sets to 0).
"""

from __future__ import annotations

from typing import Any

import msgspec


# 0.5.8
class EventBatch058(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class KVCacheEvent058(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored058(KVCacheEvent058, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class BlockRemoved058(KVCacheEvent058, tag="BlockRemoved"):
    block_hashes: list[int]


class AllBlocksCleared058(KVCacheEvent058, tag="AllBlocksCleared"):
    pass


class KVEventBatch058(EventBatch058):
    events: list[BlockStored058 | BlockRemoved058 | AllBlocksCleared058]


# 0.5.22+
GPU = "GPU"  # StorageMedium.GPU, a str enum: encoded as its value


class EventBatch0522(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class KVCacheEvent0522(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Tagged msgpack maps: `type` carries the class name, every other key is a field name."""


class BlockStored0522(KVCacheEvent0522, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class BlockRemoved0522(KVCacheEvent0522, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared0522(KVCacheEvent0522, tag="AllBlocksCleared"):
    pass


class KVEventBatch0522(EventBatch0522):
    events: list[BlockStored0522 | BlockRemoved0522 | AllBlocksCleared0522]
