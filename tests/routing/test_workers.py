"""Workers own their transitions: verification, health with thresholds, load."""

from __future__ import annotations

from routing.engines.identity import EngineIdentity
from routing.workers import Worker, WorkerSpec

IDENTITY = EngineIdentity(4096, 4090, 1, "0.5.23", "prefill", "glm-5", "/t", 8192)


def test_health_flips_only_after_the_configured_number_of_reads_in_a_row() -> None:
    worker = Worker(WorkerSpec("http://p", "prefill"))
    worker.accept(IDENTITY)
    for ok in (False, False, True, False, False):  # never 3 failures in a row
        worker.record_health(ok, failure_threshold=3, success_threshold=2)
    assert worker.healthy
    worker.record_health(False, failure_threshold=3, success_threshold=2)
    assert not worker.healthy and not worker.usable
    worker.record_health(True, failure_threshold=3, success_threshold=2)
    assert not worker.healthy
    worker.record_health(True, failure_threshold=3, success_threshold=2)
    assert worker.healthy and worker.usable


def test_a_worker_that_may_have_changed_leaves_rotation_and_asks_to_be_read_again() -> None:
    worker = Worker(WorkerSpec("http://p", "prefill"))
    asked: list[Worker] = []
    worker.on_needs_verification(asked.append)
    assert not worker.usable and worker.out_of_rotation_reason == "not verified yet"
    worker.accept(IDENTITY)
    assert worker.usable and worker.verified == IDENTITY
    worker.mark_changed("restarted")
    assert not worker.usable and worker.verified is None and asked == [worker]
    worker.mark_unreachable("refused")  # already out: no second wake-up
    assert asked == [worker] and worker.out_of_rotation_reason == "refused"


def test_load_counts_requests_for_as_long_as_they_run() -> None:
    worker = Worker(WorkerSpec("http://d", "decode"))
    with worker.load(), worker.load():
        assert worker.in_flight == 2
    assert worker.in_flight == 0
