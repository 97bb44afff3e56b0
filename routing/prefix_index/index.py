"""One prefill worker's cache index.

Two views, because SGLang's KV events cannot say whose pages they are: its published block hashes leave out the
request's `extra_key` (0.5.8 `RadixCache._record_store_event` hashes token ids only, via `compute_node_hash_values`;
0.5.23 `KvEventRecorder._namespace_seed` folds in `extra_key` only for LoRA adapters or `format: "dynamo"`), and
`extra_key` is how kvgate keeps tenants' caches apart. So:

- *sent*: the prompts kvgate sent to the worker, keyed per namespace, bounded by the engine's pool. A tenant is only
  ever routed by its own namespace's entries here, never by another tenant's pages.
- *held*: what the engine itself reports stored and evicted (namespace-blind), from its KV events. Being blind, an
  event may only ever lower a namespace's prediction, never raise it: a page reported stored raises nothing (it may
  be another namespace's copy), and a page reported evicted is attributed to the copy of it kvgate sent least
  recently (SGLang's radix cache evicts least-recently-used leaves first; kvgate sent every copy, so it knows their
  order): that namespace's copy stops counting until it sends the page again, and no other namespace's prediction
  moves. So A's prediction follows its own copy's estimated fate, not whether B sent an equal prompt: B's older copy
  goes first, and B's newer copy leaves A's copy the oldest, evicted first as it would be without B. When kvgate
  knows no copy of the page (it never sent one, or forgot the page under its memory bound) the eviction counts
  against every copy. Blocks kvgate just sent count before their BlockStored arrives (events trail the answer by a
  scheduler step).

A block is predicted cached when *sent* has it for the request's namespace and no eviction attributed to that copy
(or to every copy) was reported since that namespace last sent it (a clock: each record ticks it and stamps the
copies; each eviction marks the block with the stamp of the copy it took). The mode says how
much of the engine's history the events cover: all of it since the engine's cache was last empty (*exact*), or not
(*partial*: kvgate subscribed late, or lost batches it could not replay, so an eviction of a page stored before then
cannot be placed and is not seen).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

from routing.prefix_index.blocks import BLIND_SEED, PromptTokens, block_tokens_for, ids_to_bytes


class CacheMode(enum.Enum):
    APPROXIMATE = "approximate"  # no KV events (none configured, or the publisher is silent): what kvgate sent, less
    # any eviction a publisher reported before it fell silent (a prediction is never raised by losing the events)
    PARTIAL = "partial"  # events arrive but history before them is missing: sent, less what the engine evicted
    EXACT = "exact"  # every event since the engine's cache was empty: sent, and still held by the engine


def prefix_depth(keys: Sequence[int], held: Callable[[int], bool]) -> int:
    """The length of the held prefix of a chain of keys, by galloping then bisecting: O(log n) lookups rather than
    one per block. A chain is held prefix-first (a radix cache evicts leaves first, and a prompt's keys are recorded
    together), so the first key not held ends it."""
    n = len(keys)
    if not n or not held(keys[0]):
        return 0
    low, step = 0, 1  # keys[low] is held
    while True:
        probe = low + step
        if probe >= n:
            if held(keys[n - 1]):
                return n
            high = n - 1
            break
        if not held(keys[probe]):
            high = probe
            break
        low, step = probe, step * 2
    while high - low > 1:  # keys[low] held, keys[high] not
        middle = (low + high) // 2
        if held(keys[middle]):
            low = middle
        else:
            high = middle
    return high


class _Generations:
    """A map of keys to stamps bounded to `capacity` keys that forgets the least recently added first, in two halves:
    adding to the young half, and when it is full the old half is dropped and the young one becomes old. About LRU,
    at the cost of two lookups, with no per-key bookkeeping (a key costs one dict slot; one stamp object per add)."""

    __slots__ = ("_half", "_old", "_young")

    def __init__(self, capacity: int) -> None:
        self._half = max(1, capacity // 2)
        self._young: dict[int, int] = {}
        self._old: dict[int, int] = {}

    def add(self, keys: list[int], stamp: int = 1) -> None:
        for start in range(0, len(keys), self._half):
            self._young.update(dict.fromkeys(keys[start:start + self._half], stamp))
            if len(self._young) >= self._half:
                self._old, self._young = self._young, {}

    def halves(self) -> tuple[dict[int, int], dict[int, int]]:
        """The young and the old half (a key in both: the young one's stamp is its latest)."""
        return self._young, self._old

    def discard(self, key: int) -> None:
        self._young.pop(key, None)
        self._old.pop(key, None)

    def stamp(self, key: int) -> int:
        """The stamp `key` was last added with; 0 when it is not held."""
        stamp = self._young.get(key)
        return stamp if stamp is not None else self._old.get(key, 0)

    def prefix_depth(self, keys: list[int]) -> int:
        """How many of `keys`, from the first, are held (see `prefix_depth`)."""
        young, old = self._young, self._old
        return prefix_depth(keys, lambda key: key in young or key in old)

    def __contains__(self, key: int) -> bool:
        return key in self._young or key in self._old

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def clear(self) -> None:
        self._young.clear()
        self._old.clear()


class _Copies:
    """Per namespace-blind block key, the send stamps of the copies kvgate sent that no eviction was attributed to
    yet (one per namespace: a namespace sending the block again touches its own copy), oldest first. A single copy is
    stored as its stamp, several as a sorted list of at most MAX_COPIES. Bounded like `_Generations` by blind key:
    dropping the old half raises `floor` to the last stamp before the young one began (no copy of a key dropped was
    sent later; halves flip between records), so every copy whose order is forgotten counts as evicted at once,
    whoever else sent the block — never later, when an eviction of it could no longer be attributed (that would
    lower A's copy when B's went)."""

    __slots__ = ("_half", "_old", "_young", "_young_since", "floor")

    def __init__(self, capacity: int) -> None:
        self._half = max(1, capacity // 2)
        self._young: dict[int, int | list[int]] = {}
        self._old: dict[int, int | list[int]] = {}
        self._young_since = 0  # the stamp of the last record before the young half: every copy it holds is later
        self.floor = 0

    def touch(self, keys: list[int], previous: list[int], stamp: int) -> None:
        """The copies of `keys` last sent at `previous` (0: none) are sent again at `stamp`, later than every stamp
        held. Per request: the common case (the block's only copy is this one, or none) is one lookup and a store."""
        young, old, half = self._young, self._old, self._half
        for key, last in zip(keys, previous):
            copies = young.get(key)
            if copies is None:
                copies = old.pop(key, None)
            if copies is None or copies == last:
                young[key] = stamp
            else:
                if isinstance(copies, int):
                    copies = [copies]
                if last:
                    try:
                        copies.remove(last)
                    except ValueError:
                        pass  # already attributed evicted: a new copy
                copies.append(stamp)
                if len(copies) > MAX_COPIES:  # more namespaces than kept: the oldest order is forgotten
                    del copies[0]
                young[key] = copies[0] if len(copies) == 1 else copies
        if len(young) >= half:  # between records, never inside one: a record's copies share its stamp, and the
            # floor must lower every copy of the half dropped and none of the half kept (one record over half at most)
            self.floor = max(self.floor, self._young_since)
            self._old, self._young, self._young_since = young, {}, stamp

    def oldest(self, key: int) -> int | None:
        """Take the oldest copy of `key` (the one an LRU cache evicts first) and give its stamp; None when kvgate
        knows no copy of it (never sent, every copy already attributed evicted, or forgotten)."""
        for generation in (self._young, self._old):
            copies = generation.get(key)
            if copies is None:
                continue
            if isinstance(copies, int):
                del generation[key]
                return copies
            first = copies.pop(0)
            generation[key] = copies[0] if len(copies) == 1 else copies
            return first
        return None

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def clear(self) -> None:
        self._young.clear()
        self._old.clear()


MAX_COPIES = 256  # copies of one block whose send order is kept (one per namespace that sent it)


class _Evictions:
    """The index's clock and, per block (namespace-blind key) the engine reported evicted, the send stamp of the
    latest copy its evictions were attributed to: copies sent at or before it count as evicted. An eviction of a block
    is attributed to the copy of it kvgate sent least recently (SGLang's radix cache evicts least-recently-used leaves
    first), so one namespace's copy going lowers no other namespace's prediction; when kvgate knows of no copy (it
    forgot, or never sent one) every copy counts as evicted. Bounded like `_Generations`; a mark that ages out raises
    `floor` to the clock when its half began instead of vanishing, so forgetting an eviction lowers every older
    prediction rather than bringing one back."""

    __slots__ = ("_half", "_old", "_young", "_young_since", "copies", "floor", "now")

    def __init__(self, capacity: int, *, copies: int) -> None:
        self._half = max(1, capacity // 2)
        self._young: dict[int, int] = {}
        self._old: dict[int, int] = {}
        self._young_since = 0  # the clock when the young half was started: no mark in the old half is later
        self.copies = _Copies(copies)
        self.floor = 0  # every sent block stamped at or before it counts as evicted
        self.now = 0

    def tick(self) -> int:
        """A new stamp for blocks sent now (later than every eviction reported so far)."""
        self.now += 1
        return self.now

    def mark(self, key: int) -> None:
        """One copy of the block was evicted: the least recently sent one, or, when none is known, every one."""
        victim = self.copies.oldest(key)
        self._young[key] = max(self._young.get(key, 0), self._old.get(key, 0), self.now if victim is None else victim)
        if len(self._young) >= self._half:
            self.floor = max(self.floor, self._young_since)  # the old half's marks, none later, are dropped
            self._old, self._young, self._young_since = self._young, {}, self.now

    def lower_all(self) -> None:
        """Whatever was sent until now counts as evicted (what the engine evicted can no longer be told)."""
        self.floor = max(self.floor, self.now)

    def at(self, key: int) -> int:
        """The stamp up to which copies of the block count as evicted (or the floor): a copy counts only if sent
        after."""
        stamp = self._young.get(key)
        if stamp is None:
            stamp = self._old.get(key, 0)
        return max(stamp, self.floor, self.copies.floor)  # a mark older than a floor says less than the floor

    def __len__(self) -> int:
        return len(self._young) + len(self._old)


class HeldBlocks:
    """The engine's own report of its cache, rebuilt from BlockStored / BlockRemoved events at kvgate's block size.

    An engine page's hash maps to where it ends in kvgate's chain: the key of the last whole block before it and the
    tokens after that block (a page smaller than a block ends mid-block). Reference counts, because equal prompts
    in two namespaces are two radix nodes with one published hash. Evictions go to the index's `_Evictions`, shared
    by every rank: a removal marks the block for the copy kvgate sent least recently (see the module docstring)."""

    __slots__ = ("_attribute", "_blocks", "_evictions", "_max_pages", "_pages", "block_tokens", "overflows",
                 "unplaced")

    def __init__(self, block_tokens: int, evictions: _Evictions, *, max_pages: int, attribute: bool = True) -> None:
        """`max_pages`: more pages than the engine's pool can hold (or than the index's bytes allow) means events
        were lost, or the engine is broken or larger than kvgate was given room for: the view is dropped rather than
        grown without bound, and every prediction made before it is lowered."""
        self.block_tokens = block_tokens
        self._max_pages = max_pages
        self._pages: dict[int, tuple[int, bytes, int]] = {}  # engine page hash → (block key, tokens after it, refs)
        self._blocks: dict[int, int] = {}  # block key (namespace-blind) → engine pages ending it that are held
        self._evictions = evictions
        self._attribute = attribute  # per-block evictions lower predictions (else the view only follows the engine)
        self.unplaced = 0  # stored pages whose parent kvgate never saw (history it missed)
        self.overflows = 0  # times the view outgrew the engine's pool and was dropped

    def __contains__(self, key: int) -> bool:
        return key in self._blocks

    @property
    def blocks(self) -> int:
        return len(self._blocks)

    def store(self, block_hashes: list[int], parent: int | None, token_ids: list[int], page_size: int) -> bool:
        """One BlockStored: its pages (of `page_size` tokens, the last maybe shorter) in order. False when the
        parent is unknown (nothing is placed)."""
        if parent is None:
            key, tail = BLIND_SEED, b""
        else:
            found = self._pages.get(parent)
            if found is None:
                self.unplaced += len(block_hashes)
                return False
            key, tail, _ = found
        step = self.block_tokens * 4
        page_bytes = ids_to_bytes(token_ids)
        per_page = page_size * 4
        for index, page_hash in enumerate(block_hashes):
            tail += page_bytes[index * per_page:(index + 1) * per_page]
            ends_block = len(tail) >= step
            if ends_block:
                key = hash((key, tail[:step]))
                tail = tail[step:]
            previous = self._pages.get(page_hash)
            if previous is None and len(self._pages) >= self._max_pages:
                self.clear()
                self.overflows += 1
                # Evictions of the pages it placed can no longer be seen: every block sent until now stops counting
                # (never leaves one counting that the engine may have evicted meanwhile).
                if self._attribute:
                    self._evictions.lower_all()
                return False
            self._pages[page_hash] = (key, tail, (previous[2] if previous else 0) + 1)
            if ends_block and not tail:  # never clears an eviction mark: the copy stored may be another namespace's
                self._blocks[key] = self._blocks.get(key, 0) + 1
        return True

    def remove(self, block_hashes: list[int]) -> None:
        for page_hash in block_hashes:
            found = self._pages.get(page_hash)
            if found is None:
                continue
            key, tail, refs = found
            if refs > 1:
                self._pages[page_hash] = (key, tail, refs - 1)
            else:
                del self._pages[page_hash]
            if not tail:  # the page ended a block: one copy fewer, whose namespace the event does not say
                if self._attribute:
                    self._evictions.mark(key)
                left = self._blocks.get(key, 0) - 1
                if left > 0:
                    self._blocks[key] = left
                else:
                    self._blocks.pop(key, None)

    def clear(self) -> None:
        """Forget the placement of pages (the eviction marks stay: they only ever lower a prediction)."""
        self._pages.clear()
        self._blocks.clear()


DEFAULT_INDEX_BYTES = 1 << 30  # routing.cache_aware_index_bytes
PAGE_BYTES = 256  # what one engine page held costs a view (measured: ~245 B at page size 1 and 16, CPython 3.11)
KEY_BYTES = 96  # what one block key costs the sent view or the eviction marks (a dict slot and a 64-bit int)


class CacheIndex:
    """What kvgate knows of one prefill's radix cache (see the module docstring). `ranks` holds one engine view per
    data-parallel rank publishing events (each rank has its own radix cache): an eviction on any rank lowers.

    Bounded by the engine's pool (its claim) and by `max_bytes`, whichever is less: an eighth of it each for the
    sent keys, the copies' send order and the eviction marks, the rest for the engine views, shared by the ranks."""

    def __init__(self, *, page_size: int, capacity_tokens: int, max_bytes: int = DEFAULT_INDEX_BYTES,
                 per_block_evictions: bool = False) -> None:
        """`per_block_evictions`: an engine's report of each block it evicted lowers a prediction, charged to the copy
        kvgate sent least recently (sharper, but with the channels README lists: a blind event cannot say whose copy
        went). Off, the engine's events count only for what they say of the whole cache (a restart, a clear, a
        refused publisher): a namespace's prediction is then what it sent, aged by the volume sent after it —
        nothing in it depends on which prompts another namespace sent."""
        self.per_block_evictions = per_block_evictions
        self.page_size = max(1, page_size)
        self.block_tokens = block_tokens_for(self.page_size)
        self.pool_blocks = max(1, capacity_tokens // self.block_tokens)
        # Twice the pool: a key forgotten then had a pool's worth of blocks sent after it, so an LRU engine has
        # evicted it too. The copies' send order (below) must outlive the copies: forgetting one still held would
        # attribute its eviction to a newer copy, another namespace's, and that namespace's prediction would read
        # whether the forgotten copy existed. Under a smaller byte budget this no longer holds, and the floors
        # lower every copy whose order is forgotten, at once.
        self.capacity_blocks = min(2 * self.pool_blocks, max(1, max_bytes // 8 // KEY_BYTES))
        self._view_bytes = max_bytes - 3 * (max_bytes // 8)
        self._sent = _Generations(self.capacity_blocks)  # namespaced key → the clock when last sent
        self._evictions = _Evictions(self.capacity_blocks, copies=self.capacity_blocks)
        self.ranks: list[HeldBlocks] = []
        self.mode = CacheMode.APPROXIMATE
        self.events_refused: str | None = None  # why the engine's KV events are not followed (None: they are)

    def engine_view(self, *, of_ranks: int = 1) -> HeldBlocks:
        """A new view of one publishing rank's cache (the KV-event subscriber fills it), one of `of_ranks`."""
        # Twice the pool in pages (a margin for events that trail: hashes shared by namespaces count once here),
        # and never more than the rank's share of the bytes.
        if self.per_block_evictions and not self.ranks and len(self._sent):
            # Sent before any copy's order was kept: none of it can be attributed.
            self._evictions.copies.floor = max(self._evictions.copies.floor, self._evictions.now)
        pool_pages = 2 * self.pool_blocks * self.block_tokens // self.page_size
        view = HeldBlocks(self.block_tokens, self._evictions,
                          max_pages=max(1, min(pool_pages, self._view_bytes // max(1, of_ranks) // PAGE_BYTES)),
                          attribute=self.per_block_evictions)
        self.ranks.append(view)
        return view

    def match(self, prompt: PromptTokens) -> int:
        """Tokens of the prompt's prefix predicted to be in the engine's cache, for the prompt's namespace."""
        keys = prompt.keys(self.block_tokens)
        if not keys or not self._sent.stamp(keys[0]):
            return 0
        evictions = self._evictions
        if not evictions.floor and not len(evictions) and not evictions.copies.floor:  # no eviction ever reported,
            # no copy's order forgotten: what kvgate sent
            return self._sent.prefix_depth(keys) * self.block_tokens
        # Sent by this namespace after the engine last reported the block evicted (from any copy, on any rank), in
        # every mode: a publisher that falls silent does not make what it reported evicted count again.
        # A scan, not `prefix_depth`'s gallop: evictions are charged per block to a copy, so the blocks counted need
        # not be a prefix (a block charged while its children are not), and the engine serves a prefix only.
        blind = prompt.keys(self.block_tokens, namespaced=False)
        sent, evicted = self._sent.stamp, self._evictions.at
        depth = 0
        for key, blind_key in zip(keys, blind):
            if sent(key) <= evicted(blind_key):
                break
            depth += 1
        return depth * self.block_tokens

    def record(self, prompt: PromptTokens) -> None:
        """The prompt was sent to this worker: its prefill will hold the prompt's blocks in its namespace."""
        # Every block the engine will hold, the last one of a prompt of whole blocks included: a copy kvgate did not
        # record would have its eviction charged to another namespace's copy.
        keys = prompt.keys(self.block_tokens, stored=True)
        stamp = self._evictions.tick()
        if self.ranks and self.per_block_evictions:  # the order of copies matters only to attribute evictions
            young, old = self._sent.halves()
            previous = [young.get(key) or old.get(key, 0) for key in keys]  # the namespace's copy, touched again
            self._evictions.copies.touch(prompt.keys(self.block_tokens, namespaced=False, stored=True), previous,
                                         stamp)
        self._sent.add(keys, stamp)

    def forget_sent(self) -> None:
        """The engine's cache is empty (a restart, a flush): nothing kvgate sent before is there any more."""
        self._sent.clear()
        self._evictions.copies.clear()

    def reset(self) -> None:
        self._sent.clear()
        self._evictions.copies.clear()
        for rank in self.ranks:
            rank.clear()

    @property
    def sent_blocks(self) -> int:
        return len(self._sent)

    @property
    def held_blocks(self) -> int:
        return sum(rank.blocks for rank in self.ranks)

    @property
    def view_overflows(self) -> int:
        return sum(rank.overflows for rank in self.ranks)
