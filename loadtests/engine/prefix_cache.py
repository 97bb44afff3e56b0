"""SGLang's radix prefix cache (`mem_cache/radix_cache.py`), as a prefill holds it, without the KV itself.

* Namespaces: a request's `extra_key` (the OpenAI routes fold `cache_salt` in front of it:
  serving_base._compute_extra_key in 0.5.8) keys its own subtree, so different namespaces never share a page.
* Pages: keys are inserted page-aligned (`_page_align_keys`) and matched page-aligned; a request is matched on all
  but its last token (`Req.init_next_round_input`: the last token is always computed), so `cached_tokens` is the
  longest cached page-aligned prefix of `prompt[:-1]`.
* Capacity: `capacity_tokens` (the emulator keeps the cache apart from the request KV pool: SGLang's cache lives in
  the pool and is evicted to make room for a batch). A radix insert that needs room first evicts least recently used
  whole leaf nodes, as `RadixCache.evict` does, sparing the path it extends (held by `lock_ref` in SGLang); a prompt
  larger than what can be freed is inserted as far as it fits.
* Events: with a recorder, each new node's pages are hashed (block_hash.py) and recorded as stored, each evicted
  node's pages as removed, a flush as all cleared (`_record_store_event` / `_record_remove_event` /
  `_record_all_cleared_event`); the recorder decides the wire shape per version.

Edges are lists of token ids, so matching a 4k-token prompt is a few slice comparisons in C, not a loop per token
(~0.1 ms); hashing, only with events on, costs one SHA-256 per new page (~3 ms for 4k fresh pages of one token).
"""

from __future__ import annotations

import heapq
from array import array
from typing import Any, Protocol

from .block_hash import chain


def namespace(body: dict[str, Any]) -> str:
    parts = [body.get(key) for key in ("cache_salt", "extra_key")]
    return "".join(part for part in parts if isinstance(part, str))


class CacheEvents(Protocol):
    """What the cache reports for KV events (kv_event_recorder.py builds each version's events)."""

    def stored(self, hashes: array, parent: int | None, tokens: list[int], page_size: int) -> None: ...

    def removed(self, hashes: array) -> None: ...

    def cleared(self) -> None: ...


class _Node:
    __slots__ = ("children", "digest", "hashes", "key", "parent", "tick")

    def __init__(self, key: list[int], parent: _Node | None, tick: int) -> None:
        self.key = key
        self.children: dict[Any, _Node] = {}
        self.parent = parent
        self.tick = tick  # last access (a counter: LRU order without clock ties)
        self.hashes: array | None = None  # int64 per page, with events on
        self.digest: bytes | None = None  # last page's SHA-256, what a child's first page chains from


class PrefixCache:
    def __init__(self, capacity_tokens: int, page_size: int, events: CacheEvents | None = None) -> None:
        self.page = page_size
        self.capacity = capacity_tokens - capacity_tokens % page_size
        self.events = events
        self._roots: dict[str, _Node] = {}
        self._space_of: dict[_Node, str] = {}  # root -> its namespace
        self._leaves: set[_Node] = set()
        self._tick = 0
        self.tokens = 0
        self.evicted_pages = 0

    # lookups
    def match(self, space: str, ids: list[int]) -> int:
        """Cached tokens for a prompt about to be prefilled (refreshes the matched path's LRU position)."""
        return self._match(space, ids, touch=True)

    def peek(self, space: str, ids: list[int]) -> int:
        """`match` without touching the LRU order (load estimates)."""
        return self._match(space, ids, touch=False)

    def _match(self, space: str, ids: list[int], touch: bool) -> int:
        root = self._roots.get(space)
        usable = len(ids) - 1
        usable -= usable % self.page
        if root is None or usable <= 0:
            return 0
        path, partial, _, matched = self._walk(root, ids[:usable])
        if touch:
            self._touch(path, partial)
        return matched

    # updates
    def insert(self, space: str, ids: list[int]) -> None:
        """Cache a prefilled prompt (`cache_unfinished_req` after the forward): its whole pages."""
        n = len(ids) - len(ids) % self.page
        if n == 0 or self.capacity <= 0:
            return
        key = ids[:n]
        root = self._roots.get(space)
        if root is None:
            root = self._roots[space] = _Node([], None, 0)
            self._space_of[root] = space
        path, partial, inside, matched = self._walk(root, key)
        self._touch(path, partial)
        new = n - matched
        if new <= 0:
            return
        over = self.tokens + new - self.capacity
        if over > 0:
            self._evict(over, {*path, partial} if partial is not None else set(path))
            room = self.capacity - self.tokens
            if room < new:
                new = room - room % self.page
                if new <= 0:
                    return
        parent = self._split(partial, inside) if partial is not None else path[-1]
        leaf = _Node(key[matched:matched + new], parent, self._tick)
        parent.children[self._child_key(leaf.key, 0)] = leaf
        self._leaves.discard(parent)
        self._leaves.add(leaf)
        self.tokens += new
        if self.events is not None:
            leaf.hashes, leaf.digest = chain(parent.digest, leaf.key, self.page)
            parent_hash = parent.hashes[-1] if parent.parent is not None and parent.hashes else None
            self.events.stored(leaf.hashes, parent_hash, leaf.key, self.page)

    def flush(self) -> None:
        """`RadixCache.reset` (/flush_cache): everything goes, one all-cleared event."""
        self._roots.clear()
        self._space_of.clear()
        self._leaves.clear()
        self.tokens = 0
        if self.events is not None:
            self.events.cleared()

    def stats(self) -> dict[str, int]:
        return {"pages": self.tokens // self.page, "tokens": self.tokens, "capacity_tokens": self.capacity,
                "evicted_pages": self.evicted_pages}

    # the tree
    def _child_key(self, key: list[int], pos: int) -> Any:
        return key[pos] if self.page == 1 else tuple(key[pos:pos + self.page])

    def _walk(self, root: _Node, key: list[int]) -> tuple[list[_Node], _Node | None, int, int]:
        """(fully matched nodes from the root, the node the match ends inside or None, tokens matched inside it,
        tokens matched in all)."""
        node, pos, n, path = root, 0, len(key), [root]
        while pos < n:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            m = self._common(child.key, key, pos)
            pos += m
            if m < len(child.key):
                return path, (child if m else None), m, pos
            node = child
            path.append(child)
        return path, None, 0, pos

    def _common(self, edge: list[int], key: list[int], pos: int) -> int:
        """Page-aligned length of the common prefix of `edge` and `key[pos:]` (`_key_match_paged`)."""
        limit = min(len(edge), len(key) - pos)
        if edge[:limit] == key[pos:pos + limit]:
            m = limit
        else:
            lo, hi = 0, limit  # edge[:lo] matches, edge[:hi] does not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if edge[lo:mid] == key[pos + lo:pos + mid]:
                    lo = mid
                else:
                    hi = mid
            m = lo
        return m - m % self.page

    def _touch(self, path: list[_Node], partial: _Node | None) -> None:
        self._tick += 1
        for node in path:
            node.tick = self._tick
        if partial is not None:
            partial.tick = self._tick

    def _split(self, child: _Node, at: int) -> _Node:
        """`_split_node`: `child` keeps its tail under a new node holding its first `at` tokens."""
        parent = child.parent
        assert parent is not None
        head = _Node(child.key[:at], parent, child.tick)
        parent.children[self._child_key(child.key, 0)] = head
        child.key = child.key[at:]
        child.parent = head
        head.children[self._child_key(child.key, 0)] = child
        if child.hashes is not None:  # split_node_hash_value; the head's chain state is recomputed
            pages = at // self.page
            head.hashes, child.hashes = child.hashes[:pages], child.hashes[pages:]
            head.digest = chain(parent.digest, head.key, self.page)[1]
        return head

    def _evict(self, need: int, spared: set[_Node]) -> None:
        """Least recently used leaves first; a parent left childless becomes a candidate (`RadixCache.evict`)."""
        heap = [(leaf.tick, id(leaf), leaf) for leaf in self._leaves if leaf not in spared]
        heapq.heapify(heap)
        evicted = 0
        while evicted < need and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[self._child_key(node.key, 0)]
            self._leaves.discard(node)
            evicted += len(node.key)
            self.tokens -= len(node.key)
            self.evicted_pages += len(node.key) // self.page
            if self.events is not None and node.hashes is not None:
                self.events.removed(node.hashes)
            if parent.parent is None:  # a namespace's root: gone with its last page (unless being extended)
                if not parent.children and parent not in spared:
                    del self._roots[self._space_of.pop(parent)]
            elif not parent.children:
                self._leaves.add(parent)
                if parent not in spared:
                    heapq.heappush(heap, (parent.tick, id(parent), parent))

