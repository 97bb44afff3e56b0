"""Load-balancing policies: each picks one worker among the usable ones, or None."""

from routing.policies.base import Policy
from routing.policies.round_robin import RoundRobin

__all__ = ["Policy", "RoundRobin"]
