"""Prefix-cache salts: SGLang namespaces its radix cache by `extra_key` (the OpenAI routes' `cache_salt` is folded
into it: serving_base._compute_extra_key in 0.5.8), so requests with different salts never share cached KV pages and
one tenant cannot learn another's prompt by timing cache hits (arXiv 2411.18191). kvgate sets the salt on both halves
to a keyed hash of the tenant's cache group; a client's own salt only subdivides its tenant's space."""

from __future__ import annotations

import hashlib
import hmac
from functools import lru_cache


class CacheSalts:
    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        # Most requests name one of a few groups and no salt of their own: an HMAC per request is work for nothing.
        self._of_group = lru_cache(maxsize=4096)(self._keyed)

    def salt(self, cache_group: str, client_salt: str | None = None) -> str:
        if client_salt is None and len(cache_group) <= 256:  # (what is kept stays small)
            return self._of_group(cache_group, None)
        return self._keyed(cache_group, client_salt)

    def _keyed(self, cache_group: str, client_salt: str | None) -> str:
        group, salt = cache_group.encode(), (client_salt or "").encode()
        message = len(group).to_bytes(4, "big") + group + salt  # length-prefixed: no two inputs read alike
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()[:32]
