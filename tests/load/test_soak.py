"""The soak's short form in the suite (the long one is `python -m loadtests.soak`, 10 minutes by default): 20 s of
mixed traffic with faults on both halves and clients leaving, then its own assertions — no descriptor or memory
growth, nothing held or left running on the engines, no 200 for a failed request, no canary leak."""

from __future__ import annotations

import pytest

from loadtests.soak import run

pytestmark = pytest.mark.long_running(seconds=40)


@pytest.mark.timeout(240)
def test_a_short_soak_with_faults_and_disconnects_passes_its_assertions(capsys: pytest.CaptureFixture[str]) -> None:
    code = run(seconds=20)
    output = capsys.readouterr().out
    assert code == 0, output
    assert "soak_ok=1" in output
