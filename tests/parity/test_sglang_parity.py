"""kvgate's count against SGLang's own request code (not this project's emulator), per supported SGLang version.

For every generated request (`loadtests.sglang_reference.cases`): SGLang's own HTTP request path, in its venv, gives
the prompt ids the scheduler would get, or its refusal; kvgate's admission gives its count and the body it forwards;
the emulator gives its ids. `loadtests.sglang_reference.compare` states the rules and the listed differences.
"""

from __future__ import annotations

import time

import pytest

from loadtests.sglang_reference import build, cases, compare, kvgate_side, reference

pytestmark = pytest.mark.long_running(seconds=120)


@pytest.mark.parametrize("version", build.VERSIONS)
def test_kvgate_counts_as_sglang_does(version: str) -> None:
    started = time.monotonic()
    all_cases = cases.all_cases()
    sglang = reference.sglang_answers(version, all_cases)
    kvgate = kvgate_side.kvgate_answers(version, all_cases)
    forwarded_cases = [{"id": c["id"], "route": c["route"], "body": kvgate[c["id"]].engine_body}
                       for c in all_cases if kvgate[c["id"]].status == 200]
    forwarded = reference.sglang_answers(version, forwarded_cases)
    emulator = kvgate_side.emulator_answers(version, all_cases)
    report = compare.compare(version, all_cases, sglang, kvgate, forwarded, emulator)
    assert report.listed is not None
    print(f"\nSGLang {version}: {len(all_cases)} cases, {report.served_equal} served with equal counts, "
          f"{report.both_refuse} refused by both, {sum(map(len, report.listed.values()))} listed differences, "
          f"{time.monotonic() - started:.0f} s")
    for reason, ids in report.listed.items():
        print(f"  listed ({len(ids)}): {reason[:110]}…")
    assert not report.failures, "\n".join(report.failures)
    assert report.served_equal > 150  # the comparison really ran
