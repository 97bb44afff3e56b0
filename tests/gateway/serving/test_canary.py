"""`kvgate canary`: markers, then prompts of limit−1, limit, limit+1, 2×limit and pool+1 tokens through the gateway's
own admission and dispatch path. With normal admission it finds no leak and every over-limit prompt refused; with
an engine that lies about its pool and reports the full prompt count (so nothing else catches it), it reports the
leak and exits non-zero."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from gateway.commands.canary import run_canary
from gateway.config import load_config
from loadtests.engine.harness import EnginePair, start_pair
from tests.engine_records import wait_for
from tests.gateway_harness import model_entry, running_gateway, write_config


def test_with_normal_admission_no_probe_leaks_and_every_over_limit_prompt_is_refused(
        glm_pair: EnginePair, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = load_config(write_config(tmp_path, [model_entry("glm-5", [glm_pair.prefill], [glm_pair.decode])]))
    assert run_canary(config) == 0
    out = capsys.readouterr().out
    rows = {line.split()[1]: int(line.split()[-1]) for line in out.splitlines() if "tokens ->" in line}
    assert rows["limit-1"] == rows["limit"] == 200  # the limit itself is served
    assert rows["limit+1"] == rows["2xlimit"] == 413 and "no leak" in out


def test_an_engine_that_lies_about_its_pool_is_caught_leaking(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    # The claimed pool puts the limit at 16,377: the near-limit probes overflow the real pool, and the stub prefill
    # reports the full count (--hide-stub), so only the answers show the leak.
    with start_pair(prefill_pool=4096, decode_pool=100_000, context_length=16384, model="glm-5", version="0.5.8",
                    bug=True, prefill_opts={"report_pool_tokens": 100_000, "hide_stub": True}) as pair:
        entry = model_entry("glm-5", [pair.prefill], [pair.decode], context_length=16384, min_engine_version="0.5.8")
        config = load_config(write_config(tmp_path, [entry]))
        code = run_canary(config)
    out = capsys.readouterr().out
    assert code == 1 and "LEAK" in out and "BROKEN" in out, out


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_the_background_prober_runs_on_its_interval_and_finds_no_leak(glm_pair: EnginePair, tmp_path: Path) -> None:
    entry = model_entry("glm-5", [glm_pair.prefill], [glm_pair.decode], integrity={"canary_interval_s": 0.2})
    with running_gateway(write_config(tmp_path, [entry])) as gateway:
        assert wait_for(lambda: _metric(gateway.url, "kvgate_canary_probes_total", result="413") >= 6, timeout_s=10)
        assert _metric(gateway.url, "kvgate_canary_probes_total", result="200") >= 4  # the markers
        assert _metric(gateway.url, "kvgate_canary_leaks_total") == 0


def test_the_background_prober_near_the_limit_catches_a_lying_engine(tmp_path: Path) -> None:
    with start_pair(prefill_pool=4096, decode_pool=100_000, context_length=16384, model="glm-5", version="0.5.8",
                    bug=True, prefill_opts={"report_pool_tokens": 100_000, "hide_stub": True}) as pair:
        entry = model_entry("glm-5", [pair.prefill], [pair.decode], context_length=16384, min_engine_version="0.5.8",
                            integrity={"canary_interval_s": 0.2, "canary_near_limit": True})
        with running_gateway(write_config(tmp_path, [entry])) as gateway:
            assert wait_for(lambda: _metric(gateway.url, "kvgate_canary_leaks_total") >= 1, timeout_s=20)
            assert _metric(gateway.url, "kvgate_canary_probes_total", result="leak") >= 1
