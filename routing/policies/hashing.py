"""Rendezvous (highest-random-weight) hashing over 64-bit integers: the same key picks the same worker on every
gateway replica, and a worker leaving moves only the keys it held."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from routing.workers import Worker

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread 64-bit mix."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def ranked(workers: Sequence[Worker], key: int) -> Iterable[Worker]:
    """`workers` from the most to the least preferred for `key`."""
    return sorted(workers, key=lambda w: _mix(key ^ w.hash_seed), reverse=True)


def first_ranked(workers: Sequence[Worker], key: int) -> Worker:
    """The most preferred worker for `key` (what `ranked` lists first, without sorting the rest)."""
    return max(workers, key=lambda w: _mix(key ^ w.hash_seed))
