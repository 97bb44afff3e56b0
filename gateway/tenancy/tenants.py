"""API keys → tenants. Keys are kept hashed (sha256), in YAML or in the shared state; a client presents its key as
`Authorization: Bearer KEY`, as the OpenAI SDK does."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.config import AuthConfig, TenantConfig, TenantLimitsConfig
from gateway.tenancy.errors import StateDown, Unauthorized
from routing.state import FleetState, StateUnavailable

log = logging.getLogger("kvgate.tenancy")
_NO_LIMITS = TenantLimitsConfig()
_KEY_CACHE_S = 10.0  # how long a key looked up in the shared state is trusted (a revoked key works this long)


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str  # a configured tenant's name; "key:…" or "addr:…" for a client no tenant claims
    limits: TenantLimitsConfig = _NO_LIMITS
    cache_group: str | None = None  # who shares its prefix-cache salt (itself unless configured)

    @property
    def salt_group(self) -> str:
        return self.cache_group or self.name

    @property
    def admission_line(self) -> str:
        """Whose line its large bodies wait in (gateway.admission.fair_share): its own when configured; one line for
        every client no tenant claims, so throwaway keys or addresses cannot each take a share."""
        return "anonymous:" if self.name.startswith(("key:", "addr:")) else self.name

    @property
    def limited(self) -> bool:
        return self.limits is not _NO_LIMITS and self.limits != _NO_LIMITS  # (identity first: pydantic's == is slow)


# The gateway's own canary traffic (its secret header checked by gateway.integrity.probe): no key, no limits, own salt.
CANARY = Tenant("kvgate:canary")


class TenantDirectory:
    def __init__(self, auth: AuthConfig, tenants: list[TenantConfig], state: FleetState) -> None:
        self.required = auth.required
        if not auth.required:
            log.warning("auth.required is false: a client without an API key is told apart by its address only, so "
                        "keyless clients behind one proxy or NAT share one tenant and one prefix-cache namespace")
        self._by_name = {t.name: _tenant(t) for t in tenants}
        self._by_key = {key.removeprefix("sha256:"): self._by_name[t.name] for t in tenants for key in t.api_keys}
        self._state = state
        self._looked_up: dict[str, tuple[float, Tenant | None]] = {}

    async def identify(self, headers: Sequence[tuple[bytes, bytes]], client: tuple[str, int] | None) -> Tenant:
        """The tenant a request belongs to; 401 when auth is required and no known key was presented."""
        key = _bearer_key(headers)
        if key is None:
            if self.required:
                raise Unauthorized("missing API key: send it as 'Authorization: Bearer KEY'")
            return Tenant(f"addr:{client[0]}" if client else "addr:unknown")
        digest = hashlib.sha256(key).hexdigest()
        tenant = self._by_key.get(digest) or await self._from_state(digest)
        if tenant is not None:
            return tenant
        if self.required:
            raise Unauthorized("invalid API key")
        return Tenant("key:" + digest[:32])

    async def _from_state(self, digest: str) -> Tenant | None:
        now = time.monotonic()
        cached = self._looked_up.get(digest)
        if cached is not None and cached[0] > now:
            return cached[1]
        try:
            name = await self._state.api_key_tenant(digest)
        except StateUnavailable:
            # Not known: never cached as "no such key". A key seen before keeps its tenant through the outage;
            # an unseen one cannot be judged where keys are required (neither 401 nor served without its tenant's
            # limits: 503); where they are not, it is served as any unknown key is.
            if cached is not None:
                return cached[1]
            if not self.required:
                return None
            raise StateDown() from None
        tenant = None if name is None else self._by_name.get(name) or Tenant(name)
        if len(self._looked_up) > 100_000:  # many distinct wrong keys: start over rather than grow
            self._looked_up.clear()
        self._looked_up[digest] = (now + _KEY_CACHE_S, tenant)
        return tenant


def _tenant(config: TenantConfig) -> Tenant:
    return Tenant(config.name, config.limits, config.cache_group)


def _bearer_key(headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name == b"authorization":
            return bearer_key_of(value)
    return None


def bearer_key_of(authorization: bytes) -> bytes:
    """The key an Authorization header value names, however it is spelled (`Bearer`, `bearer`, extra spaces): one
    key, one tenant, one connection share. A value of another scheme is taken whole."""
    scheme, _, key = authorization.strip().partition(b" ")
    key = key.strip()
    return key if scheme.lower() == b"bearer" and key else authorization.strip()
