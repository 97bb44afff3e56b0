"""The incident's deployment gate beyond the pool: transfer backend, settings that must match across the roles,
version skew, deferred KV release and transfer bounds (when the engines expose their environment), metrics — judged
per worker from /server_info over real HTTP, in preflight (table, JSON, exit code), /readyz, metrics and the admin
API."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.commands.preflight import collect, report, run_preflight
from gateway.config import load_config
from loadtests.engine.harness import EnginePair, start_pair
from routing.deployment_checks import CheckPolicy, check_worker
from routing.engines.identity import EngineIdentity, RenderingSettings, TransferSettings, parse_identity
from tests.gateway_harness import model_entry, running_gateway, write_config

EXPOSED_GOOD = {"expose_env_vars": True, "env": ["SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES=256"]}


def _identity(role: str, version: str = "0.5.23", **settings: Any) -> EngineIdentity:
    defaults: dict[str, Any] = {"backend": "mooncake", "kv_checksum": False, "decode_allocation_policy": "early",
                                "metrics_enabled": True, "env_vars": None}
    return EngineIdentity(20000, 8185, 1, version, role, "glm-5", "/t", None,
                          settings=TransferSettings(**{**defaults, **settings}))


def _results(role: str, identity: EngineIdentity, other: EngineIdentity, **policy: Any) -> dict[str, str]:
    return {c.check: c.result for c in check_worker(role, identity, [identity, other], CheckPolicy(**policy))}


def test_each_check_reads_its_setting_and_says_unverified_when_it_cannot() -> None:
    decode = _identity("decode")
    assert _results("prefill", _identity("prefill", backend="fake"), decode)["transfer_backend"] == "fail"
    assert _results("prefill", _identity("prefill", version="0.5.22"), decode)["version_skew"] == "fail"
    assert _results("prefill", _identity("prefill", kv_checksum=True), decode)["kv_checksum_match"] == "fail"
    hidden = _results("prefill", _identity("prefill"), decode)
    assert hidden["transfer_batch_bound"] == hidden["deferred_kv_release"] == "unverified"
    unbounded = _results("prefill", _identity("prefill", env_vars=()), decode)  # exposed: absent means default
    assert unbounded["transfer_batch_bound"] == "fail" and unbounded["deferred_kv_release"] == "pass"
    off = _identity("decode", env_vars=(("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "false"),))
    assert _results("decode", off, _identity("prefill"))["deferred_kv_release"] == "fail"
    short = _identity("decode", env_vars=(("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT", "20"),))
    assert _results("decode", short, _identity("prefill"))["release_timeout"] == "fail"
    assert _results("decode", short, _identity("prefill"), transfer_timeout_s=15)["release_timeout"] == "pass"
    old = _results("decode", _identity("decode", version="0.5.8", kv_checksum=None, decode_allocation_policy=None),
                   _identity("prefill", version="0.5.8", kv_checksum=None, decode_allocation_policy=None))
    assert old["deferred_kv_release"] == "fail" and old["kv_checksum_match"] == "pass"  # neither has a checksum
    assert _results("prefill", _identity("prefill", metrics_enabled=False), decode)["metrics_enabled"] == "fail"


def test_values_are_read_as_sglang_reads_them() -> None:
    prefill = _identity("prefill")
    for raw, result in (("n", "fail"), ("No", "fail"), ("0", "fail"), (" false ", "pass"), ("off", "pass"),
                        ("y", "pass"), ("<ranks disagree>", "fail")):
        decode = _identity("decode", env_vars=(("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", raw),))
        assert _results("decode", decode, prefill)["deferred_kv_release"] == result, raw  # EnvBool: exact spellings
    for raw, result in (("inf", "fail"), ("nan", "fail"), ("45", "pass")):
        decode = _identity("decode", env_vars=(("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT", raw),))
        assert _results("decode", decode, prefill)["release_timeout"] == result, raw
    bound = (("SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES", "64"),)
    assert _results("prefill", _identity("prefill", backend="MOONCAKE_TCP", env_vars=bound),
                    _identity("decode"))["transfer_batch_bound"] == "pass"  # normalised, then bounded
    assert _results("prefill", _identity("prefill", backend="nixl", env_vars=()),
                    _identity("decode", backend="nixl"))["transfer_batch_bound"] == "unverified"  # nothing to read
    nvlink = (*bound, ("SGLANG_MOONCAKE_CUSTOM_MEM_POOL", "INTRA_NODE_NVLINK"))
    assert _results("prefill", _identity("prefill", env_vars=nvlink), _identity("decode"))["transfer_batch_bound"] \
        == "pass"
    assert _results("prefill", _identity("prefill", version="0.5.22rc1"), _identity("decode", version="0.5.22rc1"))[
        "deferred_kv_release"] == "unverified"  # a pre-release's default is not the release's
    assert _results("prefill", _identity("prefill", version="0.5.23+cu128"), _identity("decode"))[
        "version_skew"] == "pass"
    newer = _identity("decode", kv_checksum=True)
    old = _identity("prefill", version="0.5.8", kv_checksum=None, decode_allocation_policy=None)
    assert _results("decode", newer, old)["kv_checksum_match"] == "fail"  # 0.5.8 computes none: they differ
    assert _results("prefill", prefill, _identity("decode"), require_kv_checksum=True)["kv_checksum_match"] == "fail"


def test_one_worker_that_differs_is_the_one_that_fails() -> None:
    good_p, good_d = _identity("prefill"), _identity("decode")
    odd = _identity("decode", backend="nixl")
    fleet = [good_p, _identity("prefill"), good_d, odd]
    results = {id(i): {c.check: c.result for c in check_worker(i.disaggregation_mode, i, fleet, CheckPolicy())}
               for i in fleet}
    assert results[id(odd)]["transfer_backend"] == "fail"
    assert all(results[id(i)]["transfer_backend"] == "pass" for i in (good_p, good_d))


def test_every_policy_in_the_yaml_reaches_the_gate(tmp_path: Path) -> None:
    from gateway.serving.models import model_spec
    from routing.engine_info import EngineInfo, Reading
    from routing.gate import judge_model
    from routing.workers import Worker, WorkerSpec

    names = ("deferred_kv_release", "transfer_batch_bound", "release_timeout", "metrics_enabled")
    entry = model_entry("glm-5", [], [], max_prompt_tokens=4000,
                        deployment_checks={**dict.fromkeys(names, "refuse"), "transfer_timeout_s": 45,
                                           "require_kv_checksum": True})
    entry.update(prefill=[{"url": "http://p:1"}], decode=[{"url": "http://d:1"}])
    path = write_config(tmp_path, [entry])
    spec = model_spec(load_config(path).models[0])
    env = (("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "0"),)
    readings = {Worker(WorkerSpec("http://p:1", "prefill")): Reading(EngineInfo(_identity("prefill", env_vars=env,
                                                                                          metrics_enabled=False), None)),
                Worker(WorkerSpec("http://d:1", "decode")): Reading(EngineInfo(_identity("decode", env_vars=env,
                                                                                         metrics_enabled=False), None))}
    judgement = judge_model(spec, readings, startup=True)
    refused = {p.split(":")[0] for w in judgement.workers for p in w.problems}
    # each one, set to refuse, keeps the workers out (release timeout: 30 s < 45 s; the checksum is off)
    assert refused == {*names, "kv_checksum_match"}
    assert judgement.verdict == "refuse"


def test_an_engine_that_renders_chats_its_own_way_fails_unless_kvgate_applies_the_same() -> None:
    def result(rendering: RenderingSettings, decode_rendering: RenderingSettings = RenderingSettings(),
               **policy: Any) -> str:
        prefill = dataclasses.replace(_identity("prefill"), rendering=rendering)
        decode = dataclasses.replace(_identity("decode"), rendering=decode_rendering)
        return _results("prefill", prefill, decode, **policy)["engine_chat_rendering"]

    assert result(RenderingSettings()) == "pass"
    glm = RenderingSettings(default_chat_template_kwargs='{"clear_thinking": false}')
    assert result(glm, glm) == "pass"  # kvgate applies the defaults the model's workers share
    assert result(glm) == "fail"  # one set of defaults for the model: a worker without them differs
    assert result(RenderingSettings(), glm) == "fail"
    moved = RenderingSettings(default_chat_template_kwargs='{"reasoning_effort": "high"}')
    assert result(moved, moved) == "fail"  # SGLang moves it out of the kwargs: not a default kvgate can merge
    call = RenderingSettings(default_chat_template_kwargs='{"padding": "max_length"}')
    assert result(call, call, unmergeable_template_kwargs=frozenset({"padding"})) == "fail"  # not a variable
    odd = RenderingSettings(default_chat_template_kwargs='"enable_thinking"')
    assert result(odd, odd) == "fail"  # not an object
    assert result(RenderingSettings(completion_template="deepseek_coder")) == "fail"
    assert result(RenderingSettings(chat_template="/models/tools.jinja")) == "fail"
    assert result(RenderingSettings(chat_template="/models/tools.jinja"), chat_template_configured=True) == "pass"
    # As SGLang 0.5.23 reports it in /server_info (ServerArgs flattened), and unset as 0.5.8 reports it.
    info = {"max_total_num_tokens": 20000, "max_req_input_len": 8185, "chat_template": None,
            "default_chat_template_kwargs": {"clear_thinking": False, "enable_thinking": True}}
    assert parse_identity(info).rendering == RenderingSettings(
        default_chat_template_kwargs='{"clear_thinking": false, "enable_thinking": true}')
    assert parse_identity({**info, "default_chat_template_kwargs": None}).rendering == RenderingSettings()


@pytest.mark.parametrize("action", [None, "warn"])
def test_engine_chat_rendering_in_the_yaml_reaches_the_gate(tmp_path: Path, action: str | None) -> None:
    from gateway.serving.models import model_spec
    from routing.engine_info import EngineInfo, Reading
    from routing.gate import judge_model
    from routing.workers import Worker, WorkerSpec

    checks = {"engine_chat_rendering": action} if action else {}
    entry = model_entry("glm-5", [], [], max_prompt_tokens=4000, deployment_checks=checks)
    entry.update(prefill=[{"url": "http://p:1"}], decode=[{"url": "http://d:1"}])
    spec = model_spec(load_config(write_config(tmp_path, [entry])).models[0])
    own_defaults = RenderingSettings(default_chat_template_kwargs='{"clear_thinking": false}')
    readings = {Worker(WorkerSpec("http://p:1", "prefill")): Reading(EngineInfo(
                    dataclasses.replace(_identity("prefill"), rendering=own_defaults), None)),
                Worker(WorkerSpec("http://d:1", "decode")): Reading(EngineInfo(_identity("decode"), None))}
    judgement = judge_model(spec, readings, startup=True)
    problems = [p for w in judgement.workers for p in w.problems]
    if action is None:  # refused by default: the engine would render a prompt kvgate did not count
        assert judgement.verdict == "refuse" and any(p.startswith("engine_chat_rendering") for p in problems)
    else:
        assert judgement.verdict != "refuse" and not problems


CLUSTERS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # (prefill options, decode options)
    "fake_backend": ({"transfer_backend": "fake"}, {}),
    "version_skew": ({"version": "0.5.22"}, {}),
    "checksum_mismatch": ({"enable_kv_checksum": True}, {}),
    "exposed_unbounded": ({"expose_env_vars": True}, {"expose_env_vars": True}),
    "hidden_unbounded": ({}, {}),
    "good": (EXPOSED_GOOD, {"expose_env_vars": True}),
}


@pytest.fixture(scope="module")
def clusters() -> Iterator[dict[str, EnginePair]]:
    started: dict[str, EnginePair] = {}
    try:
        for name, (prefill, decode) in CLUSTERS.items():
            version = prefill.pop("version", "0.5.23")
            started[name] = start_pair(prefill_pool=20000, decode_pool=20000, context_length=8192, model="glm-5",
                                       version="0.5.23", prefill_opts={**prefill, "version": version},
                                       decode_opts=decode)
        yield started
    finally:
        for pair in started.values():
            pair.stop()


def _config(tmp_path: Path, pair: EnginePair, **model: Any) -> Path:
    return write_config(tmp_path, [model_entry("glm-5", [pair.prefill], [pair.decode], **model)])


def _checks(tmp_path: Path, pair: EnginePair, **model: Any) -> tuple[dict[str, Any], dict[tuple[str, str], Any]]:
    import asyncio

    data = report(asyncio.run(collect(load_config(_config(tmp_path, pair, **model)))))
    found = {(w["role"], c["check"]): c for m in data["models"] for w in m["workers"] for c in w["checks"]}
    return data, found


def test_a_fake_transfer_backend_is_refused(clusters: dict[str, EnginePair], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    pair = clusters["fake_backend"]
    data, checks = _checks(tmp_path, pair)
    assert checks[("prefill", "transfer_backend")]["result"] == "fail"
    assert checks[("prefill", "transfer_backend")]["value"].startswith("fake")
    assert checks[("decode", "transfer_backend")]["result"] == "fail"  # the two roles differ
    assert not data["ok"] and data["models"][0]["verdict"] == "refuse"
    assert run_preflight(load_config(_config(tmp_path, pair)), as_json=False) == 1
    printed = capsys.readouterr().out
    assert "transfer_backend" in printed and "FAIL (refuse)" in printed and printed.rstrip().endswith("above")


def test_version_skew_is_warned_and_refused_under_refuse(clusters: dict[str, EnginePair], tmp_path: Path) -> None:
    pair = clusters["version_skew"]
    data, checks = _checks(tmp_path, pair)
    assert checks[("prefill", "version_skew")]["result"] == "fail"
    assert checks[("prefill", "version_skew")]["value"] == "0.5.22 vs 0.5.23 elsewhere in the model"
    assert data["ok"] and data["models"][0]["verdict"] == "warn"
    strict, _ = _checks(tmp_path, pair, deployment_checks={"version_skew": "refuse"})
    assert not strict["ok"] and strict["models"][0]["verdict"] == "refuse"


def test_a_checksum_mismatch_between_the_roles_is_reported_and_keeps_the_workers_out(
        clusters: dict[str, EnginePair], tmp_path: Path) -> None:
    pair = clusters["checksum_mismatch"]
    data, checks = _checks(tmp_path, pair)
    assert checks[("prefill", "kv_checksum_match")]["value"] == "true vs false elsewhere in the model"
    assert checks[("decode", "kv_checksum_match")]["result"] == "fail" and not data["ok"]
    config = write_config(tmp_path, [model_entry("glm-5", [pair.prefill], [pair.decode])],
                          gate={"start_anyway": True})
    with running_gateway(config) as gateway:
        ready = httpx.get(gateway.url + "/readyz", timeout=10)
        assert ready.status_code == 503 and "kv_checksum_match: fail" in json.dumps(ready.json())
        metrics = httpx.get(gateway.url + "/metrics", timeout=10).text
        assert ('kvgate_worker_check{check="kv_checksum_match",model="glm-5",result="fail",role="prefill",'
                f'worker="{pair.prefill.url}"}} 1.0') in metrics


def test_an_unbounded_mooncake_batch_is_flagged_when_exposed_and_unverified_when_not(
        clusters: dict[str, EnginePair], tmp_path: Path) -> None:
    data, exposed = _checks(tmp_path, clusters["exposed_unbounded"])
    assert exposed[("prefill", "transfer_batch_bound")]["result"] == "fail"
    assert exposed[("prefill", "transfer_batch_bound")]["value"] == "0 (default: one unbounded batch)"
    assert exposed[("decode", "release_timeout")]["result"] == "pass"  # 30 s default ≥ 30 s stated
    assert exposed[("decode", "deferred_kv_release")]["value"] == "true (default)"
    assert data["ok"]  # warn by default
    hidden_data, hidden = _checks(tmp_path, clusters["hidden_unbounded"])
    assert hidden[("prefill", "transfer_batch_bound")]["result"] == "unverified"
    assert hidden[("decode", "release_timeout")]["result"] == "unverified" and hidden_data["ok"]
    required, _ = _checks(tmp_path, clusters["hidden_unbounded"],
                          deployment_checks={"require_verified_transfer_settings": True})
    assert not required["ok"]


def test_preflight_table_and_json_for_a_passing_cluster(clusters: dict[str, EnginePair], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    config = load_config(_config(tmp_path, clusters["good"], deployment_checks={
        "require_verified_transfer_settings": True, "transfer_timeout_s": 20}))
    assert run_preflight(config, as_json=True) == 0
    data = json.loads(capsys.readouterr().out)
    results = {(w["role"], c["check"]): c["result"] for w in data["models"][0]["workers"] for c in w["checks"]}
    assert set(results.values()) == {"pass"} and len(results) == 16  # 8 checks on each of the two workers
    assert run_preflight(config, as_json=False) == 0
    table = capsys.readouterr().out
    assert "deployment checks:" in table and re.search(r"prefill .* transfer_batch_bound +PASS +256 ", table)
    assert table.rstrip().endswith("passes the deployment checks")


def test_the_admin_api_lists_each_workers_checks(clusters: dict[str, EnginePair], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_TEST_ADMIN_TOKEN", "t")
    pair = clusters["version_skew"]
    config = write_config(tmp_path, [model_entry("glm-5", [pair.prefill], [pair.decode])],
                          admin={"token_env": "KVGATE_TEST_ADMIN_TOKEN"})
    with running_gateway(config) as gateway:
        workers = httpx.get(gateway.url + "/admin/workers", headers={"authorization": "Bearer t"}).json()["workers"]
    prefill = next(w for w in workers if w["role"] == "prefill")
    skew = next(c for c in prefill["checks"] if c["check"] == "version_skew")
    assert skew == {"check": "version_skew", "result": "fail", "value": "0.5.22 vs 0.5.23 elsewhere in the model",
                    "safe": "the same SGLang version on every prefill and decode", "policy": "warn"}
    assert prefill["in_rotation"]  # warn: reported, still serving


def test_the_emulator_exposes_only_the_variables_set_explicitly_and_never_mooncakes_own(tmp_path: Path) -> None:
    env = ["SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES=64", "MC_TRANSFER_TIMEOUT=30"]
    with start_pair(prefill_pool=4096, decode_pool=4096, context_length=2048, version="0.5.23",
                    prefill_opts={"expose_env_vars": True, "env": env, "transfer_backend": "mooncake_tcp"}) as pair:
        info = httpx.get(pair.prefill.url + "/server_info", timeout=10).json()
        assert info["internal_states"][0]["env_vars"] == {"SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES": "64"}
        assert info["disaggregation_transfer_backend"] == "mooncake"  # resolved, as ServerArgs.resolved_dict()
        assert "env_vars" not in httpx.get(pair.decode.url + "/server_info", timeout=10).json()["internal_states"][0]
