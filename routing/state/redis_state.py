"""The fleet's state in Redis (a single server, or a Sentinel-managed primary), shared by every replica.

Every call has a short timeout and no retries of its own: a slow or absent Redis must never hold a request;
`routing.state.resilient` decides what a failure means."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import orjson
from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from routing.state import redis_scripts as lua
from routing.state.base import Budget, FleetReport, FleetView, Ledger, TenantDecision

log = logging.getLogger("kvgate.state")

PREFIX = "kvgate:"
ABORT_REPLY_WAIT_S = 0.25  # how long an abort by id waits for the replicas' answers


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """Where the primary is: a URL, or Sentinels that know it by service name."""

    url: str | None = None
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str | None = None
    timeout_s: float = 0.25


def connect(target: RedisTarget) -> Redis:
    timeout = target.timeout_s
    if target.sentinels:
        assert target.service is not None
        options = dict(socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0),
                       health_check_interval=0)
        sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=dict(options), **options)
        master: Redis = sentinel.master_for(target.service, socket_timeout=timeout, socket_connect_timeout=timeout,
                                            retry=Retry(NoBackoff(), 0), health_check_interval=0)
        return master
    assert target.url is not None
    return Redis.from_url(target.url, socket_timeout=timeout, socket_connect_timeout=timeout,
                          retry=Retry(NoBackoff(), 0), health_check_interval=0)


@dataclass(slots=True)
class _RegistryDelta:
    """Requests started and finished since the last sync (sent in batches: no Redis call per request)."""

    started: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)


class RedisState:
    shared = True

    def __init__(self, target: RedisTarget, *, lease_s: float = 30.0, replica: str | None = None) -> None:
        self.replica = replica or uuid.uuid4().hex[:12]
        self.target = target
        self.lease_s = lease_s
        self._redis = connect(target)
        self._admit = self._redis.register_script(lua.ADMIT)
        self._charge = self._redis.register_script(lua.CHARGE)
        self._release = self._redis.register_script(lua.RELEASE)
        self._sync = self._redis.register_script(lua.SYNC)
        self._abort = self._redis.register_script(lua.ABORT)
        self._leave = self._redis.register_script(lua.LEAVE)
        self._delta = _RegistryDelta()
        self._resnapshot = False
        self._news = asyncio.Event()
        self._listener: asyncio.Task[None] | None = None
        self._abort_here: Callable[[str], int] = lambda request_id: 0
        self._replies: set[asyncio.Task[None]] = set()
        # (tenant, budget kind) → (level, per_min, when): each bucket as the last admit left it, for a fallback
        self.last_levels: dict[tuple[str, str], tuple[float, int, float]] = {}

    async def admit_tenant(self, tenant: str, budgets: Sequence[Budget], max_concurrent: int | None,
                           held_here: int = 0, seq: int = 0) -> TenantDecision:
        args: list[str | int] = [self.replica, -1 if max_concurrent is None else max_concurrent, len(budgets)]
        for budget in budgets:
            args += [budget.kind, budget.per_min, budget.cost]
        args += [tenant, held_here, seq]
        admitted, wait, why, _elsewhere, *levels = await self._admit(
            keys=[f"{PREFIX}bucket:{tenant}", f"{PREFIX}conc:{tenant}", f"{PREFIX}replicas",
                  f"{PREFIX}conc_tenants:{self.replica}", f"{PREFIX}conc_floor:{self.replica}"], args=args)
        self._remember_levels(tenant, budgets, levels)
        return TenantDecision(bool(admitted), float(wait), why.decode() if isinstance(why, bytes) else why)

    def _remember_levels(self, tenant: str, budgets: Sequence[Budget], levels: list[bytes]) -> None:
        if len(self.last_levels) > 100_000:
            self.last_levels.clear()
        now = time.monotonic()
        for budget, level in zip(budgets, levels, strict=False):
            if level:  # empty: not read (refused by max_concurrent first)
                self.last_levels[(tenant, budget.kind)] = (float(level), budget.per_min, now)

    async def release_tenant(self, tenant: str, held_here: int = 0, seq: int = 0) -> None:
        await self._release(keys=[f"{PREFIX}conc:{tenant}", f"{PREFIX}conc_floor:{self.replica}"],
                            args=[self.replica, held_here, seq])

    async def charge(self, tenant: str, budget: Budget) -> Ledger:
        await self._charge(keys=[f"{PREFIX}bucket:{tenant}"], args=[budget.kind, budget.per_min, budget.cost])
        return "shared"

    async def give_back(self, tenant: str, budget: Budget, ledger: Ledger) -> None:
        if ledger == "shared":  # a negative charge: the script caps the level at the bucket's size when read
            await self._charge(keys=[f"{PREFIX}bucket:{tenant}"], args=[budget.kind, budget.per_min, -budget.cost])

    async def sync(self, report: FleetReport) -> FleetView:
        self._ensure_listener()
        delta, self._delta = self._delta, _RegistryDelta()
        document = {"loads": report.loads, "limits": report.limits, "concurrency": report.concurrency,
                    "seq": report.seq, "started": delta.started, "finished": delta.finished}
        if self._resnapshot:
            document["snapshot"] = report.requests
        try:
            raw = await self._sync(args=[PREFIX, self.replica, self.lease_s, orjson.dumps(document)])
        except BaseException:
            # Maybe applied, maybe not: the changes are dropped (never piled up) and the next sync replaces the
            # registry with what is in flight then.
            self._resnapshot = True
            raise
        self._resnapshot = False
        view = orjson.loads(raw)
        return FleetView(loads_elsewhere=_mapping(view["loads"]), limits=_mapping(view["limits"]),
                         disabled=_mapping(view["disabled"]), aborts=tuple(view["aborts"] or ()),
                         replicas=tuple(view["replicas"] or ()))

    async def set_disabled(self, model: str, disabled: bool, *, cancel_inflight: bool = False) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            if disabled:
                pipe.hset(f"{PREFIX}disabled", model, "1" if cancel_inflight else "0")
            else:
                pipe.hdel(f"{PREFIX}disabled", model)
            pipe.publish(f"{PREFIX}news", "switch")
            await pipe.execute()

    async def register_request(self, request_id: str) -> None:
        self._delta.started.append(request_id)

    async def unregister_request(self, request_id: str) -> None:
        self._delta.finished.append(request_id)

    async def request_abort(self, request_id: str) -> list[str]:
        """Publish the question, then wait (up to ABORT_REPLY_WAIT_S) for every replica that heard it to answer:
        those that held the id, and the registry's owners that did not answer (they abort it at their next sync)."""
        reply = f"{PREFIX}abort_reply:{uuid.uuid4().hex}"
        pubsub = self._redis.pubsub()
        try:
            await pubsub.subscribe(reply)
            await _subscribed(pubsub, self.target.timeout_s)  # no answer can come before the ear is open
            question = orjson.dumps({"id": request_id, "reply": reply, "from": self.replica})
            heard, *registered = await self._abort(args=[PREFIX, request_id, self.replica, question])
            answers = await _answers(pubsub, int(heard), ABORT_REPLY_WAIT_S)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(pubsub.aclose(), 1.0)
        owners = {owner.decode() for owner in registered} - answers.keys()
        owners |= {replica for replica, held in answers.items() if held > 0}
        owners.discard(self.replica)
        return sorted(owners)

    def serve_aborts(self, abort: Callable[[str], int]) -> None:
        self._abort_here = abort

    def _answer_abort(self, data: bytes) -> None:
        """Another replica asks for a request id: abort it here if held, and say how many (0 too)."""
        question = orjson.loads(data)
        request_id, asking = str(question["id"]), question["from"]
        held = 0 if asking == self.replica else self._abort_here(request_id)
        task = asyncio.get_running_loop().create_task(self._reply(str(question["reply"]), request_id, held))
        self._replies.add(task)
        task.add_done_callback(self._replies.discard)

    async def _reply(self, channel: str, request_id: str, held: int) -> None:
        with contextlib.suppress(RedisError, OSError, TimeoutError):  # unanswered: the asker relies on the registry
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.lrem(f"{PREFIX}aborts:{self.replica}", 0, request_id)  # answered now: not again at the sync
                pipe.publish(channel, orjson.dumps({"replica": self.replica, "held": held}))
                await pipe.execute()

    async def api_key_tenant(self, key_hash: str) -> str | None:
        tenant = await self._redis.hget(f"{PREFIX}api_keys", key_hash)
        return tenant.decode() if isinstance(tenant, bytes) else None

    async def shared_secret(self, name: str) -> bytes:
        key = f"{PREFIX}secret:{name}"
        await self._redis.set(key, secrets.token_hex(32), nx=True)
        value = await self._redis.get(key)
        assert isinstance(value, bytes)  # the client does not decode responses
        return bytes.fromhex(value.decode())

    async def wait_for_news(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._news.wait(), timeout_s)
        self._news.clear()

    def _ensure_listener(self) -> None:
        if self._listener is None or self._listener.done():
            self._listener = asyncio.get_running_loop().create_task(self._listen())

    async def _listen(self) -> None:
        """Wake the sync loop as soon as a kill switch flips, and answer aborts by id at once (the periodic sync
        would see both anyway: pub/sub only makes them faster, and a lost message costs one sync interval)."""
        while True:
            pubsub: PubSub | None = None
            try:
                pubsub = self._redis.pubsub()
                await pubsub.subscribe(f"{PREFIX}news", f"{PREFIX}abort")
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is None:
                        continue
                    if message["channel"] == f"{PREFIX}abort".encode():
                        self._answer_abort(message["data"])
                    else:
                        self._news.set()
            except (RedisError, OSError):
                await asyncio.sleep(1.0)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):  # bounded: a half-open subscription must not hold a stop
                        await asyncio.wait_for(pubsub.aclose(), 1.0)

    async def leave(self) -> None:
        await self._leave(args=[PREFIX, self.replica])

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.wait([self._listener], timeout=2.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._redis.aclose(), 2.0)


async def _subscribed(pubsub: PubSub, timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        while (message := await pubsub.get_message(timeout=timeout_s)) is None or message["type"] != "subscribe":
            pass


async def _answers(pubsub: PubSub, expected: int, wait_s: float) -> dict[str, int]:
    """Replica → how many of the request it held, from the replies that came within `wait_s`."""
    answers: dict[str, int] = {}
    deadline = asyncio.get_running_loop().time() + wait_s
    while len(answers) < expected and (left := deadline - asyncio.get_running_loop().time()) > 0:
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=left)
        if message is not None and message["type"] == "message":
            answer = orjson.loads(message["data"])
            answers[str(answer["replica"])] = int(answer["held"])
    return answers


def _mapping(value: object) -> dict:  # type: ignore[type-arg]
    """cjson encodes an empty Lua table as {} (never []): both mean nothing here."""
    return value if isinstance(value, dict) else {}
