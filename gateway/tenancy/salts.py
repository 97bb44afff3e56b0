"""Prefix-cache salts: SGLang namespaces its radix cache by `extra_key` (the OpenAI routes' `cache_salt` is folded
into it: serving_base._compute_extra_key in 0.5.8), so requests with different salts never share cached KV pages and
one tenant cannot learn another's prompt by timing cache hits (arXiv 2411.18191). kvgate sets the salt on both halves
to a keyed hash of the tenant's cache group; a client's own salt only subdivides its tenant's space."""

from __future__ import annotations

import hashlib
import hmac


class CacheSalts:
    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def salt(self, cache_group: str, client_salt: str | None = None) -> str:
        group, salt = cache_group.encode(), (client_salt or "").encode()
        message = len(group).to_bytes(4, "big") + group + salt  # length-prefixed: no two inputs read alike
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()[:32]
