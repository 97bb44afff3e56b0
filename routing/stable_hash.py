"""64-bit hashes that are the same in every process and on every gateway replica (Python's str hash is salted)."""

from __future__ import annotations

import hashlib


def stable_hash(*parts: bytes) -> int:
    digest = hashlib.blake2b(digest_size=8)
    for part in parts:
        digest.update(len(part).to_bytes(4, "little"))
        digest.update(part)
    return int.from_bytes(digest.digest(), "little")
