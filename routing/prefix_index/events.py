"""SGLang's KV event batches, decoded: `(topic, sequence, payload)` messages whose payload is msgpack
`[ts, events, attn_dp_rank?]` (`sglang/srt/disaggregation/kv_events.py` `EventBatch`).

The events come in two shapes. 0.5.8 encodes them array-like with the class name first
(`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id]`); 0.5.22+ as tagged maps
(`{"type": "BlockStored", "block_hashes": [...], ...}`, optional fields left out), and coalesces one chain's pages
into one event (`KvEventRecorder.enqueue`). Both decode to the same three types here. Anything else is a
malformed batch: the subscriber counts it and skips it whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec


@dataclass(frozen=True, slots=True)
class Stored:
    block_hashes: list[int]
    parent: int | None
    token_ids: list[int]
    page_size: int


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: list[int]


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


KVEvent = Stored | Removed | Cleared


class MalformedBatch(ValueError):
    pass


_decoder = msgspec.msgpack.Decoder()
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size")


def decode_sequence(frame: bytes) -> int:
    if len(frame) != 8:
        raise MalformedBatch(f"a sequence frame of {len(frame)} bytes")
    return int.from_bytes(frame, "big", signed=True)


def decode_batch(payload: bytes) -> list[KVEvent]:
    try:
        batch = _decoder.decode(payload)
        if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
            raise MalformedBatch("not an event batch [ts, events, ...]")
        return [_event(raw) for raw in batch[1]]
    except MalformedBatch:
        raise
    except Exception as exc:  # msgspec's errors, RecursionError on deep nesting, anything else a payload provokes
        raise MalformedBatch(f"not an event batch: {type(exc).__name__}") from None


def _event(raw: Any) -> KVEvent:
    kind: Any
    if isinstance(raw, list) and raw and isinstance(raw[0], str):  # 0.5.8: array-like, tag first
        kind, fields = raw[0], raw[1:]
        if kind == "BlockStored" and len(fields) >= 4:
            return _stored(*fields[:4])
        if kind == "BlockRemoved" and len(fields) >= 1:
            return Removed(_ints(fields[0]))
        if kind == "AllBlocksCleared":
            return Cleared()
    elif isinstance(raw, dict):  # 0.5.22+: tagged maps
        kind = raw.get("type")
        if kind == "BlockStored" and all(f in raw or f == "parent_block_hash" for f in _STORED_FIELDS):
            return _stored(*(raw.get(f) for f in _STORED_FIELDS))
        if kind == "BlockRemoved" and "block_hashes" in raw:
            return Removed(_ints(raw["block_hashes"]))
        if kind == "AllBlocksCleared":
            return Cleared()
    raise MalformedBatch(f"not a KV event: {type(raw).__name__}")  # never str(raw): it may nest deep


def _stored(hashes: Any, parent: Any, token_ids: Any, block_size: Any) -> Stored:
    hashes, token_ids = _ints(hashes), _ints(token_ids)
    if parent is not None and not _is_int(parent):
        raise MalformedBatch("parent_block_hash is not an integer")
    if not _is_int(block_size) or block_size < 1 or not hashes:
        raise MalformedBatch("block_size is not a positive integer")
    if not (len(hashes) - 1) * block_size < len(token_ids) <= len(hashes) * block_size:
        raise MalformedBatch(f"{len(token_ids)} token ids for {len(hashes)} pages of {block_size}")
    if any(not 0 <= t < 1 << 32 for t in token_ids):
        raise MalformedBatch("a token id outside 32 bits")
    return Stored(hashes, parent, token_ids, block_size)


def _ints(value: Any) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise MalformedBatch("expected a list of integers")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
