"""Load-balancing policies: each picks one worker among those in rotation with room, or None. Adding a policy is one
file and one line in `POLICIES`."""

from __future__ import annotations

from collections.abc import Callable

from routing.policies.affinity import PrefixAffinity, SessionAffinity
from routing.policies.base import NO_KEY, Policy, RouteKey
from routing.policies.cache_aware import CacheAware
from routing.policies.kv_headroom import KvHeadroom
from routing.policies.least_outstanding import LeastOutstanding
from routing.policies.power_of_two import PowerOfTwo
from routing.policies.random_choice import RandomChoice
from routing.policies.round_robin import RoundRobin

# name → factory(load_max_age_s)
POLICIES: dict[str, Callable[[float], Policy]] = {
    "round_robin": lambda _: RoundRobin(),
    "random": lambda _: RandomChoice(),
    "least_outstanding": lambda _: LeastOutstanding(),
    "power_of_two": lambda max_age_s: PowerOfTwo(max_age_s),
    "prefix_affinity": lambda _: PrefixAffinity(),
    "session_affinity": lambda _: SessionAffinity(),
    "cache_aware": lambda _: CacheAware(),
    "kv_headroom": lambda max_age_s: KvHeadroom(max_age_s),
}


def make_policy(name: str, *, load_max_age_s: float) -> Policy:
    return POLICIES[name](load_max_age_s)


__all__ = ["NO_KEY", "POLICIES", "Policy", "RouteKey", "make_policy"]
