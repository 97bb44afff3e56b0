"""The cyclic collector as the gateway sets it once started: young collections rare under a working set of requests
in flight, cycles still collected. Run in a child process (freezing pytest's own heap would change other tests)."""

from __future__ import annotations

import subprocess
import sys

from tests.gateway_harness import ROOT

_CHILD = """
import gc
import random
from collections import deque
from gateway.http.server import YOUNG_COLLECTION_THRESHOLD, settle_collector

def in_flight(settled):
    if settled:
        settle_collector()
    else:
        gc.collect()
    runs = []
    gc.callbacks.append(lambda phase, info: phase == "start" and runs.append(info["generation"]))
    # Up to 128 requests in flight, each holding ~100 young containers; they start and finish in no fixed order.
    rng, window = random.Random(0), deque()
    for _ in range(6000):
        if window and (len(window) >= 128 or rng.random() < 0.5):
            window.popleft()
        else:
            window.append([{"k": [i]} for i in range(50)])
    gc.callbacks.clear()
    return len(runs)

default_runs = in_flight(False)
settled_runs = in_flight(True)
assert gc.get_threshold()[0] == YOUNG_COLLECTION_THRESHOLD
assert gc.get_freeze_count() > 0

class Node:
    pass

collected = []
gc.callbacks.append(lambda phase, info: phase == "stop" and collected.append(info["collected"]))
for _ in range(30_000):  # cycles a failure path might leave: still found, once enough of them piled up
    a, b = Node(), Node()
    a.peer, b.peer = b, a
    del a, b
print(default_runs, settled_runs, sum(collected))
"""


def test_young_collections_are_rare_with_requests_in_flight_and_cycles_are_still_collected() -> None:
    done = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    default_runs, settled_runs, cycles_collected = map(int, done.stdout.split())
    assert default_runs >= 50  # Python's default: every time the young containers grew by 700
    assert settled_runs <= 2
    assert cycles_collected >= 10_000  # nothing piles up for good
