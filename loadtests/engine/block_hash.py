"""SGLang's position-aware KV block hashes, as its radix cache publishes them in KV events.

A page's hash is SHA-256 over the previous page's digest (none for a prompt's first page) followed by each token id
as 4 little-endian unsigned bytes (`hicache_storage.get_hash_str` in 0.5.8, `mem_cache/utils.get_hash_str` in
0.5.22+); the published id is the digest's first 8 bytes as a signed big-endian int64 (`hash_str_to_int64`, which
reads the first 16 hex characters). The chain covers token ids only: `extra_key` never enters it (0.5.22+ seeds it
with `cache_salt` alone, which kvgate never sends, and with the request's namespace only in the "dynamo" format).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

try:  # CPython's own SHA-256: ~40% less per-call overhead than OpenSSL's on 36-byte inputs (one call per page)
    from _sha256 import sha256 as _sha256  # type: ignore[import-not-found]  # 3.11
except ImportError:
    try:
        from _sha2 import sha256 as _sha256  # type: ignore[import-not-found,no-redef]  # 3.12+
    except ImportError:
        _sha256 = hashlib.sha256  # type: ignore[assignment]

_LITTLE = sys.byteorder == "little"


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Each token as `t.to_bytes(4, "little", signed=False)`, concatenated (ids outside uint32 wrap, where SGLang
    would fail the request)."""
    try:
        packed = array("I", tokens)
    except OverflowError:
        packed = array("I", [t & 0xFFFFFFFF for t in tokens])
    if not _LITTLE:
        packed.byteswap()
    return packed.tobytes()


def chain(prior: bytes | None, tokens: Sequence[int], page_size: int) -> tuple[array, bytes | None]:
    """Hashes (int64) of the pages of `tokens` chained after digest `prior`, and the last page's digest.

    `tokens` holds whole pages only, as the radix cache inserts page-aligned keys."""
    data = token_bytes(tokens)
    step = 4 * page_size
    digests: list[bytes] = []
    append, sha256 = digests.append, _sha256
    first, digest = 0, prior
    if not digest and data:  # `if prior_hash:` - the root has none
        digest = sha256(data[:step]).digest()
        append(digest)
        first = step
    for start in range(first, len(data), step):
        digest = sha256(digest + data[start:start + step]).digest()
        append(digest)
    out = array("q")
    out.frombytes(b"".join([d[:8] for d in digests]))  # big-endian int64 heads, converted at once
    if _LITTLE:
        out.byteswap()
    return out, digest


def reference_page_hashes(tokens: Sequence[int], page_size: int) -> list[int]:
    """The slow, literal form of `chain` from the root (tests and documentation): one hex digest per page."""
    hashes: list[int] = []
    prior: str | None = None
    for start in range(0, len(tokens) - len(tokens) % page_size, page_size):
        hasher = hashlib.sha256()
        if prior:
            hasher.update(bytes.fromhex(prior))
        for t in tokens[start:start + page_size]:
            hasher.update(t.to_bytes(4, byteorder="little", signed=False))
        prior = hasher.hexdigest()
        value = int(prior[:16], 16)
        hashes.append(value - 2**64 if value >= 2**63 else value)
    return hashes
