"""SGLang's KV event batches, decoded: `(topic, sequence, payload)` messages whose payload is msgpack
`[ts, events, attn_dp_rank?]` (`sglang/srt/disaggregation/kv_events.py` `EventBatch`).

The events come in two shapes. 0.5.8 encodes them array-like with the class name first
(`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id]`); 0.5.22+ as tagged maps
(`{"type": "BlockStored", "block_hashes": [...], ...}`, optional fields left out), and coalesces one chain's pages
into one event (`KvEventRecorder.enqueue`). Both decode to the same three types here. Anything else, or a batch
over the caps below, is a malformed batch: the subscriber counts it and skips it whole (a batch lost: see
subscriber.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

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


# Caps on one batch, from what a real one can be. SGLang publishes one batch per scheduler step: the pages that step
# stored (a prefill step computes at most max_prefill_tokens / chunked_prefill_size new tokens, 8,192-16,384 by
# default) and the pages it evicted to make room for them (about as many). 0.5.8 spends ~45 bytes on a page stored
# (one event each) and ~25 on one removed; 0.5.22+ coalesces a node's pages (~14 and ~9 bytes a page). A default
# step at page size 1 is then at most ~1.5 MiB; the caps leave 10x that, and room for a node of a 1M-token prompt.
MAX_BATCH_BYTES = 16 * 2**20  # also the SUB and replay sockets' ZMQ_MAXMSGSIZE: a larger message is never received
MAX_BATCH_EVENTS = 1 << 19  # 524,288 events (0.5.8: about 2 x 262,144 pages at page size 1)
MAX_BATCH_PAGES = 1 << 20  # 1,048,576 page hashes in all the batch's events together (and in any one of them)
# Token ids likewise (a node of a 1M-token prompt): an event's ids are decoded in one msgspec call, which the
# 16 MiB cap alone left at 16M one-byte ids (~0.4 s of loop held, a 64 MB array stored after it).
MAX_BATCH_TOKENS = 1 << 20

_Hashes = Annotated[list[int], msgspec.Meta(max_length=MAX_BATCH_PAGES)]
_TokenIds = Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]],
                      msgspec.Meta(max_length=MAX_BATCH_TOKENS)]
_PageSize = Annotated[int, msgspec.Meta(ge=1)]


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: Any
    events: Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_BATCH_EVENTS)]  # decoded one by one


# 0.5.8: arrays led by the tag (trailing fields, lora_id and later ones, are ignored).
class _Stored058(msgspec.Struct, array_like=True, gc=False, tag="BlockStored"):
    block_hashes: _Hashes
    parent_block_hash: int | None
    token_ids: _TokenIds
    block_size: _PageSize


class _Removed058(msgspec.Struct, array_like=True, gc=False, tag="BlockRemoved"):
    block_hashes: _Hashes


class _Cleared058(msgspec.Struct, array_like=True, gc=False, tag="AllBlocksCleared"):
    pass


# 0.5.22+: maps tagged by "type" (other keys, medium and later ones, are ignored).
class _Stored0522(msgspec.Struct, gc=False, tag="BlockStored"):
    block_hashes: _Hashes
    token_ids: _TokenIds
    block_size: _PageSize
    parent_block_hash: int | None = None


class _Removed0522(msgspec.Struct, gc=False, tag="BlockRemoved"):
    block_hashes: _Hashes


class _Cleared0522(msgspec.Struct, gc=False, tag="AllBlocksCleared"):
    pass


_batch_decoder = msgspec.msgpack.Decoder(_Batch)
_array_events = msgspec.msgpack.Decoder(_Stored058 | _Removed058 | _Cleared058)
_map_events = msgspec.msgpack.Decoder(_Stored0522 | _Removed0522 | _Cleared0522)
_MAP_HEADS = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])  # msgpack fixmap, map16, map32


def decode_sequence(frame: bytes) -> int:
    if len(frame) != 8:
        raise MalformedBatch(f"a sequence frame of {len(frame)} bytes")
    return int.from_bytes(frame, "big", signed=True)


def split_batch(payload: bytes) -> list[msgspec.Raw]:
    """A batch's events, each still encoded (~1 ms a MiB: one scan, no object per id). Refuses a batch over the
    caps in bytes or events."""
    if len(payload) > MAX_BATCH_BYTES:
        raise MalformedBatch(f"a batch of {len(payload)} bytes (at most {MAX_BATCH_BYTES})")
    try:
        return _batch_decoder.decode(payload).events
    except Exception as exc:  # msgspec's errors, RecursionError on deep nesting, anything else a payload provokes
        raise MalformedBatch(f"not an event batch [ts, events, ...]: {type(exc).__name__}") from None


class EventDecoder:
    """Decodes a batch's events one at a time (the subscriber hands the loop over between them), keeping the
    batch's page and token counts under MAX_BATCH_PAGES and MAX_BATCH_TOKENS. `page_size`: the engine's (from its
    /server_info); a BlockStored of larger pages is refused (SGLang's block_size is the page's length, the page size
    or less for a last partial page), since a page's tokens past the index's block are kept as its tail."""

    __slots__ = ("page_size", "pages", "tokens")

    def __init__(self, page_size: int | None = None) -> None:
        self.page_size = page_size
        self.pages = 0
        self.tokens = 0

    def decode(self, raw: msgspec.Raw) -> KVEvent:
        try:
            head = memoryview(raw)[0] if len(raw) else -1
            decoded = (_map_events if head in _MAP_HEADS else _array_events).decode(raw)
        except Exception as exc:
            raise MalformedBatch(f"not a KV event: {type(exc).__name__}: {str(exc)[:120]}") from None
        if isinstance(decoded, _Cleared058 | _Cleared0522):
            return Cleared()
        self.pages += len(decoded.block_hashes)
        if self.pages > MAX_BATCH_PAGES:
            raise MalformedBatch(f"more than {MAX_BATCH_PAGES} pages in one batch")
        if isinstance(decoded, _Removed058 | _Removed0522):
            return Removed(decoded.block_hashes)
        hashes, token_ids, block_size = decoded.block_hashes, decoded.token_ids, decoded.block_size
        if not hashes:
            raise MalformedBatch("a BlockStored without pages")
        if self.page_size is not None and block_size > self.page_size:
            raise MalformedBatch(f"pages of {block_size} tokens from an engine whose page size is {self.page_size}")
        self.tokens += len(token_ids)
        if self.tokens > MAX_BATCH_TOKENS:
            raise MalformedBatch(f"more than {MAX_BATCH_TOKENS} token ids in one batch")
        if not (len(hashes) - 1) * block_size < len(token_ids) <= len(hashes) * block_size:
            raise MalformedBatch(f"{len(token_ids)} token ids for {len(hashes)} pages of {block_size}")
        return Stored(hashes, decoded.parent_block_hash, token_ids, block_size)


def decode_batch(payload: bytes) -> list[KVEvent]:
    """A whole batch at once (the subscriber decodes event by event, see EventDecoder)."""
    decoder = EventDecoder()
    return [decoder.decode(raw) for raw in split_batch(payload)]
