"""Workers from DNS: a role's A/AAAA records (e.g. a Kubernetes headless Service) re-read on an interval.

A new address joins through `Membership.add`, i.e. only once the KV-pool gate has read and passed it (one it refuses
is tried again next round); an address that is gone from the records is drained and dropped. A failed lookup
(timeout, SERVFAIL) changes nothing — a resolver hiccup must not empty a pool — while an authoritative answer with no
records (NXDOMAIN, no A/AAAA) drains them all."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.resolver

from routing.membership import Membership, WorkerExists, WorkerRefused
from routing.workers import Role, WorkerSpec

log = logging.getLogger("kvgate.discovery")


@dataclass(frozen=True, slots=True)
class DnsSource:
    model: str
    role: Role
    name: str
    port: int
    bootstrap_port: int | None
    interval_s: float
    scheme: str = "http"

    @property
    def origin(self) -> str:
        return f"dns:{self.name}"

    def spec(self, address: str) -> WorkerSpec:
        host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
        return WorkerSpec(f"{self.scheme}://{host}:{self.port}", self.role,
                          self.bootstrap_port if self.role == "prefill" else None, origin=self.origin)


def make_resolver(nameservers: list[str], timeout_s: float = 2.0) -> dns.asyncresolver.Resolver:
    """`nameservers` as HOST, HOST:PORT or [IPv6]:PORT; empty: the system's resolv.conf."""
    resolver = dns.asyncresolver.Resolver(configure=not nameservers)
    if nameservers:
        resolver.nameservers = [dns.nameserver.Do53Nameserver(*_host_port(entry)) for entry in nameservers]
    resolver.lifetime = timeout_s
    return resolver


def _host_port(entry: str) -> tuple[str, int]:
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else 53
    if entry.count(":") == 1:
        host, port = entry.split(":")
        return host, int(port)
    return entry, 53


async def resolve(resolver: dns.asyncresolver.Resolver, name: str) -> set[str] | None:
    """The name's addresses; None when the lookup failed (as opposed to an answer with no records)."""
    found: set[str] = set()
    for rdtype in ("A", "AAAA"):
        try:
            answer = await resolver.resolve(name, rdtype, search=False)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            continue
        except (dns.exception.DNSException, OSError) as exc:
            log.warning("DNS lookup of %s (%s) failed, keeping its workers as they are: %s", name, rdtype, exc)
            return None
        found.update(record.to_text() for record in answer)
    return found


async def initial_specs(resolver: dns.asyncresolver.Resolver, sources: list[DnsSource]) -> list[tuple[str, WorkerSpec]]:
    """One lookup of every source before startup, so that the startup gate reads the workers DNS names."""
    found = await asyncio.gather(*(resolve(resolver, source.name) for source in sources))
    return [(source.model, source.spec(address)) for source, addresses in zip(sources, found)
            for address in sorted(addresses or ())]


# A listed worker the gate refused is read again only after this long: each try puts it in its pool while it is
# read (the gate reads what is in the pool), and an engine configured too small stays so until an operator acts.
REFUSED_RETRY_S = 30.0


class Discovery:
    """Workers named by DNS: resolved once before startup, then followed on each source's interval. With no source
    it does nothing (and never reads the system's resolver configuration)."""

    def __init__(self, membership: Membership, sources: list[DnsSource], nameservers: list[str]) -> None:
        self._membership = membership
        self._sources = sources
        self._resolver = make_resolver(nameservers) if sources else dns.asyncresolver.Resolver(configure=False)
        self._tasks: list[asyncio.Task[None]] = []
        # per source: spec → when it may be tried again (monotonic seconds)
        self._refused: dict[DnsSource, dict[WorkerSpec, float]] = {source: {} for source in sources}

    async def initial(self) -> list[tuple[str, WorkerSpec]]:
        """(model, spec) of every worker the names resolve to now, before the gateway starts serving."""
        return await initial_specs(self._resolver, self._sources)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run(source), name=f"kvgate-dns-{source.name}")
                       for source in self._sources]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def refresh(self, source: DnsSource) -> None:
        addresses = await resolve(self._resolver, source.name)
        if addresses is None:
            return
        wanted = {source.spec(address) for address in addresses}
        current = {m.worker.spec: m for m in self._membership.members()
                   if m.model == source.model and m.worker.role == source.role
                   and m.worker.spec.origin == source.origin}
        for spec, member in current.items():
            if spec not in wanted:
                log.info("%s no longer lists %s: draining it", source.name, spec.url)
                self._membership.remove(member)
        refused, now = self._refused.setdefault(source, {}), time.monotonic()
        for spec in [s for s, until in refused.items() if s not in wanted or until <= now]:
            del refused[spec]  # no longer listed, or due for another try
        for spec in sorted(wanted - current.keys() - refused.keys(), key=lambda s: s.url):
            try:
                await self._membership.add(source.model, spec)
            except WorkerRefused as exc:
                refused[spec] = time.monotonic() + REFUSED_RETRY_S
                log.warning("%s lists %s, not taken (tried again in %gs): %s", source.name, spec.url,
                            REFUSED_RETRY_S, exc)
            except WorkerExists:
                pass  # also configured by URL or added by an operator

    async def _run(self, source: DnsSource) -> None:
        while True:
            await asyncio.sleep(source.interval_s)
            try:
                await self.refresh(source)
            except Exception:  # discovery must outlive any one bad round
                log.exception("DNS discovery of %s failed", source.name)
