"""The KV-pool gate against running emulated engines: refuse, clamp, asymmetric pools, role and version checks,
a restart with a smaller pool, and `kvgate preflight`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtests.engine.harness import EnginePair, start_pair
from tests.engine_records import generation_records, wait_for
from tests.gateway_harness import ROOT, free_port, model_entry, running_gateway, write_config

pytestmark = pytest.mark.long_running(seconds=23)


def _kvgate(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s)


@pytest.fixture(scope="module")
def small_prefill() -> Iterator[EnginePair]:
    """The incident's shape in miniature: context 8192 advertised, prefill pool 4096, decode pool 6000."""
    with start_pair(prefill_pool=4096, decode_pool=6000, context_length=8192, model="glm-5",
                    version="0.5.23") as pair:
        yield pair


@pytest.fixture(scope="module")
def healthy() -> Iterator[EnginePair]:
    with start_pair(prefill_pool=20000, decode_pool=20000, context_length=8192, model="glm-5",
                    version="0.5.8") as pair:
        yield pair


def test_pool_below_context_with_refuse_fails_startup_naming_the_worker(
        small_prefill: EnginePair, tmp_path: Path) -> None:
    config = write_config(tmp_path, [model_entry("glm-5", [small_prefill.prefill], [small_prefill.decode])])
    result = _kvgate("serve", "--config", str(config))
    assert result.returncode == 3
    assert small_prefill.prefill.url in result.stderr
    assert "4096" in result.stderr and "8191" in result.stderr


def test_a_refused_start_is_one_clear_block_with_no_traceback_naming_each_failing_worker_once(
        small_prefill: EnginePair, tmp_path: Path) -> None:
    config = write_config(tmp_path, [model_entry("glm-5", [small_prefill.prefill], [small_prefill.decode])])
    result = _kvgate("serve", "--config", str(config))
    output = result.stdout + result.stderr
    assert result.returncode == 3
    assert "Traceback" not in output and "Unclosed" not in output and "Exception" not in output
    # Both pools (4096 and 6000) are below the advertised 8191: each worker is named exactly once.
    assert output.count(small_prefill.prefill.url) == 1 and output.count(small_prefill.decode.url) == 1
    assert "safe prompt limit 4089" in output and "safe prompt limit 5488" in output
    assert "max_prompt_tokens: 4089" in output and "on_pool_mismatch: clamp" in output


def test_refused_model_answers_503_when_configured_to_start_anyway(small_prefill: EnginePair, tmp_path: Path) -> None:
    config = write_config(tmp_path, [model_entry("glm-5", [small_prefill.prefill], [small_prefill.decode])],
                          gate={"start_anyway": True})
    with running_gateway(config) as gateway:
        response = httpx.post(gateway.url + "/generate", json={"text": "hi"}, timeout=10)
        assert response.status_code == 503 and "KV pool" in response.json()["error"]["message"]
        address = small_prefill.prefill.url.split("//", 1)[1]
        assert address not in response.text  # a client learns what is wrong, not where the workers are
        ready = httpx.get(gateway.url + "/readyz", timeout=10)
        assert ready.status_code == 503 and "glm-5" in ready.json()["models"]
        assert address in ready.text  # the operator's probe names the worker
    assert not generation_records(small_prefill.prefill)


def test_clamp_moves_the_413_boundary_to_the_smallest_pool(small_prefill: EnginePair, tmp_path: Path) -> None:
    # Prefill pool 4096 → max_req_input_len 4090 → safe limit 4089; decode pool 6000 → 6000 - 512 reserved = 5488.
    # The minimum wins.
    limit = 4089
    config = write_config(tmp_path, [model_entry("glm-5", [small_prefill.prefill], [small_prefill.decode],
                                                 on_pool_mismatch="clamp")])
    with running_gateway(config) as gateway, httpx.Client(base_url=gateway.url, timeout=30) as client:
        assert client.get("/v1/models").json()["data"][0]["max_prompt_tokens"] == limit
        ok = client.post("/generate", json={"input_ids": [9703] * limit, "sampling_params": {"max_new_tokens": 1}})
        assert ok.status_code == 200, ok.text
        before = len(generation_records(small_prefill.prefill))
        over = client.post("/generate", json={"input_ids": [9703] * (limit + 1),
                                              "sampling_params": {"max_new_tokens": 1}})
        assert over.status_code == 413 and str(limit) in over.json()["error"]["message"]
        assert len(generation_records(small_prefill.prefill)) == before
        metrics = client.get("/metrics").text
        assert 'kvgate_model_effective_prompt_limit_tokens{model="glm-5"} 4089.0' in metrics
        assert 'kvgate_model_limit_clamped{model="glm-5"} 1.0' in metrics
        assert f'kvgate_worker_kv_pool_tokens{{model="glm-5",role="prefill",worker="{small_prefill.prefill.url}"}} 4096.0' in metrics


def test_a_smaller_data_parallel_rank_sets_the_limit_not_rank_0(tmp_path: Path) -> None:
    """Server info's top level is rank 0's scheduler; a prompt may land on any rank. Rank 0 holds 20,000 tokens,
    rank 1 only 5,000 (max_req_input_len 4,994 by SGLang's own rule): the limit is rank 1's, 4,993."""
    limit = 5000 - 1 - 5 - 1
    with start_pair(prefill_pool=20000, decode_pool=20000, context_length=8192, model="glm-5", version="0.5.23",
                    prefill_opts={"dp_rank_pool_tokens": [20000, 5000]}) as pair:
        info = httpx.get(pair.prefill.url + "/server_info", timeout=10).json()
        assert info["max_total_num_tokens"] == 20000 and len(info["internal_states"]) == 3
        config = write_config(tmp_path, [model_entry("glm-5", [pair.prefill], [pair.decode],
                                                     on_pool_mismatch="clamp")])
        with running_gateway(config) as gateway, httpx.Client(base_url=gateway.url, timeout=30) as client:
            assert client.get("/v1/models").json()["data"][0]["max_prompt_tokens"] == limit
            assert client.post("/generate", json={"input_ids": [9703] * limit,
                                                  "sampling_params": {"max_new_tokens": 1}}).status_code == 200
            over = client.post("/generate", json={"input_ids": [9703] * (limit + 1),
                                                  "sampling_params": {"max_new_tokens": 1}})
            assert over.status_code == 413 and str(limit) in over.json()["error"]["message"]
            metrics = client.get("/metrics").text
            assert (f'kvgate_worker_kv_pool_tokens{{model="glm-5",role="prefill",worker="{pair.prefill.url}"}} '
                    "5000.0") in metrics
            judgement = gateway.gateway.models["glm-5"].judgement
            assert judgement is not None
            assert not any("/metrics reports" in w for v in judgement.workers for w in v.warnings)


def test_prefill_worker_reporting_decode_mode_is_refused(healthy: EnginePair, tmp_path: Path) -> None:
    config = write_config(tmp_path, [model_entry("glm-5", [healthy.decode], [healthy.decode])])
    result = _kvgate("preflight", "--config", str(config), "--json")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    prefill = next(w for w in report["models"][0]["workers"] if w["role"] == "prefill")
    assert prefill["verdict"] == "refuse" and "disaggregation_mode 'decode'" in prefill["problems"][0]


def test_old_engine_is_warned_by_default_and_refused_when_strict(healthy: EnginePair, tmp_path: Path) -> None:
    config = write_config(tmp_path, [model_entry("glm-5", [healthy.prefill], [healthy.decode])])
    warned = _kvgate("preflight", "--config", str(config), "--json")
    assert warned.returncode == 0, warned.stdout + warned.stderr
    assert json.loads(warned.stdout)["models"][0]["verdict"] == "warn"
    strict = write_config(tmp_path, [model_entry("glm-5", [healthy.prefill], [healthy.decode],
                                                 on_old_engine="refuse")])
    refused = _kvgate("preflight", "--config", str(strict), "--json")
    assert refused.returncode == 1
    assert "0.5.8" in json.loads(refused.stdout)["models"][0]["workers"][0]["problems"][0]


def test_preflight_table_for_passing_and_failing_clusters(healthy: EnginePair, small_prefill: EnginePair,
                                                          tmp_path: Path) -> None:
    passing = write_config(tmp_path, [model_entry("glm-5", [healthy.prefill], [healthy.decode])])
    result = _kvgate("preflight", "--config", str(passing))
    assert result.returncode == 0
    assert "PASS" in result.stdout and "20000" in result.stdout and healthy.prefill.url in result.stdout
    failing = write_config(tmp_path, [model_entry("glm-5", [small_prefill.prefill], [small_prefill.decode])])
    result = _kvgate("preflight", "--config", str(failing))
    assert result.returncode == 1
    assert "FAIL" in result.stdout and "REFUSE" in result.stdout and "4096" in result.stdout
    report = json.loads(_kvgate("preflight", "--config", str(failing), "--json").stdout)
    assert report["ok"] is False
    model = report["models"][0]
    assert model["advertised_prompt_limit"] == 8191 and model["verdict"] == "refuse"


def test_worker_restarted_with_a_smaller_pool_is_caught_before_its_next_request(tmp_path: Path) -> None:
    with start_pair(prefill_pool=20000, decode_pool=20000, context_length=8192, model="glm-5",
                    version="0.5.23") as pair:
        config = write_config(tmp_path, [model_entry("glm-5", [pair.prefill], [pair.decode],
                                                     on_pool_mismatch="clamp")])
        with running_gateway(config) as gateway, httpx.Client(base_url=gateway.url, timeout=30) as client:
            prompt = {"input_ids": [9703] * 5000, "sampling_params": {"max_new_tokens": 1}}
            assert client.post("/generate", json=prompt).status_code == 200
            pair.decode.restart(pool_tokens=3000)
            # Whatever the timing, the 5,000-token prompt never reaches the shrunken decode: until the worker
            # is re-verified it is out of rotation (503), afterwards its smaller pool sets the limit (413).
            statuses = []
            for _ in range(40):
                statuses.append(client.post("/generate", json=prompt).status_code)
                if statuses[-1] == 413:
                    break
                wait_for(lambda: False, timeout_s=0.05)
            assert statuses[-1] == 413 and set(statuses) <= {413, 503}
            assert not [r for r in generation_records(pair.decode) if r["prompt_tokens"] == 5000]
            assert client.get("/v1/models").json()["data"][0]["max_prompt_tokens"] == 3000 - 512


def test_unreachable_worker_is_retried_until_the_startup_timeout_then_refused(tmp_path: Path) -> None:
    class Dead:
        url = f"http://127.0.0.1:{free_port()}"
        bootstrap_port = 8998

    config = write_config(tmp_path, [model_entry("glm-5", [Dead()], [Dead()])], gate={"startup_timeout_s": 1.5})
    started = time.monotonic()
    result = _kvgate("preflight", "--config", str(config), "--json")
    elapsed = time.monotonic() - started
    assert result.returncode == 1
    assert 1.0 < elapsed < 20
    workers = json.loads(result.stdout)["models"][0]["workers"]
    assert all(w["verdict"] == "refuse" and "unreachable" in w["problems"][0] for w in workers)


def test_a_restart_between_polls_with_a_smaller_pool_never_receives_a_prompt_over_its_new_limit(
        tmp_path: Path) -> None:
    """One second after the last telemetry read the prefill restarts with a 4,096-token pool (ready in ~2 s, far
    inside the 60 s poll interval), and a 5,000-token prompt follows at once: only the identity check on the new
    connection can stop it, and it must."""
    with start_pair(prefill_pool=20000, decode_pool=20000, context_length=8192, model="glm-5",
                    version="0.5.23") as pair:
        config = write_config(tmp_path, [model_entry("glm-5", [pair.prefill], [pair.decode],
                                                     on_pool_mismatch="clamp")],
                              health={"interval_s": 60.0})
        with running_gateway(config) as gateway, httpx.Client(base_url=gateway.url, timeout=30) as client:
            prompt = {"input_ids": [9703] * 5000, "sampling_params": {"max_new_tokens": 1}}
            assert client.post("/generate", json=prompt).status_code == 200  # keep-alive connections exist
            time.sleep(1.0)
            pair.prefill.restart(pool_tokens=4096)
            answer = client.post("/generate", json=prompt)
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "worker_changed"
            assert not [r for r in generation_records(pair.prefill) if r["prompt_tokens"] == 5000]
            # The failed identity check woke the monitor: the new pool is judged and sets the limit at once.
            assert wait_for(lambda: client.get("/v1/models").json()["data"][0]["max_prompt_tokens"] == 4089,
                            timeout_s=10)
            assert client.post("/generate", json=prompt).status_code == 413
            assert client.post("/generate", json={"input_ids": [9703] * 4089,
                                                   "sampling_params": {"max_new_tokens": 1}}).status_code == 200
            assert not [r for r in generation_records(pair.prefill) if r["prompt_tokens"] > 4089]


def test_telemetry_is_polled_every_interval_without_traffic(tmp_path: Path) -> None:
    with start_pair(prefill_pool=20000, decode_pool=20000, context_length=8192, model="glm-5",
                    version="0.5.23") as pair:
        config = write_config(tmp_path, [model_entry("glm-5", [pair.prefill], [pair.decode],
                                                     on_pool_mismatch="clamp")], health={"interval_s": 0.3})
        with running_gateway(config) as gateway, httpx.Client(base_url=gateway.url, timeout=30) as client:
            assert client.get("/v1/models").json()["data"][0]["max_prompt_tokens"] == 8185
            pair.decode.restart(pool_tokens=6000)
            # No request in between: only the periodic read can notice the new pool.
            assert wait_for(lambda: client.get("/v1/models").json()["data"][0]["max_prompt_tokens"] == 6000 - 512,
                            timeout_s=3)
