"""The KV-pool contract, judged from engine readings (pure rules; the end-to-end tests run real engines)."""

from dataclasses import replace

from gateway.config import ModelConfig
from gateway.serving.models import model_spec
from routing.engine_info import EngineInfo, Reading
from routing.engines.identity import EngineIdentity
from routing.gate import judge_model, version_tuple
from routing.specs import ModelSpec
from routing.workers import Worker, WorkerSpec
from tests.gateway_harness import GLM5_TOKENIZER


def _config(**overrides: object) -> ModelSpec:
    base = {"name": "glm-5", "tokenizer": GLM5_TOKENIZER, "context_length": 8192,
            "prefill": [{"url": "http://p:1"}], "decode": [{"url": "http://d:1"}]}
    return model_spec(ModelConfig.model_validate({**base, **overrides}))


def _telemetry(role: str, pool: int, context: int = 8192, version: str = "0.5.23") -> EngineInfo:
    identity = EngineIdentity(pool_tokens=pool, max_req_input_len=min(context - 1, pool - 1) - 5, page_size=1,
                              version=version, disaggregation_mode=role, served_model_name="glm-5",
                              tokenizer_path="/models/glm-5", launch_context_length=context)
    return EngineInfo(identity, context)


def _readings(prefill_pool: int, decode_pool: int, **kw: str) -> dict[Worker, Reading]:
    return {Worker(WorkerSpec("http://p:1", "prefill")): Reading(_telemetry("prefill", prefill_pool, **kw)),
            Worker(WorkerSpec("http://d:1", "decode")): Reading(_telemetry("decode", decode_pool, **kw))}


def test_pool_large_enough_passes_with_configured_limit() -> None:
    judgement = judge_model(_config(), _readings(100_000, 100_000), startup=True)
    assert judgement.verdict == "pass"
    assert judgement.effective_limit == 8185  # the engine keeps 5 tokens back: max_req_input_len - 1


def test_pool_below_context_refuses_by_default_naming_worker_and_pool() -> None:
    judgement = judge_model(_config(), _readings(4096, 100_000), startup=True)
    assert judgement.verdict == "refuse"
    assert "1 worker(s) hold less than the advertised 8191" in judgement.reasons[0]
    prefill = next(j for j in judgement.workers if j.worker.url == "http://p:1")
    assert prefill.pool_mismatch and "KV pool of 4096 tokens" in prefill.problems[0]


def test_clamp_moves_limit_to_smallest_max_req_input_len_minus_one() -> None:
    judgement = judge_model(_config(on_pool_mismatch="clamp"), _readings(4096, 100_000), startup=True)
    assert judgement.verdict == "clamp"
    assert judgement.effective_limit == 4089  # min(8191, 4095) - 5 - 1


def test_asymmetric_pools_minimum_wins() -> None:
    judgement = judge_model(_config(on_pool_mismatch="clamp"), _readings(3000, 6000), startup=True)
    assert judgement.effective_limit == 3000 - 1 - 5 - 1
    assert judgement.decode_pool_tokens == 6000


def test_a_decode_pool_must_also_hold_the_tokens_its_prealloc_queue_reserves() -> None:
    # Decode pool 3000: max_req_input_len 2994, but a prompt only schedules when prompt + 512 fits the pool.
    judgement = judge_model(_config(on_pool_mismatch="clamp"), _readings(6000, 3000), startup=True)
    assert judgement.effective_limit == 3000 - 512
    assert judgement.decode_pool_tokens == 3000
    # A pool exactly the size of the context cannot hold a context-sized prompt plus the reserve.
    exact = judge_model(_config(), _readings(100_000, 8192), startup=True)
    assert exact.verdict == "refuse" and "512 reserved for decoding" in " ".join(
        p for j in exact.workers for p in j.problems)


def test_explicit_max_prompt_tokens_that_fits_is_no_mismatch() -> None:
    judgement = judge_model(_config(max_prompt_tokens=3500), _readings(4096, 4096), startup=True)
    assert judgement.verdict == "pass" and judgement.effective_limit == 3500


def test_prefill_reporting_decode_mode_is_refused() -> None:
    readings = _readings(100_000, 100_000)
    worker = next(w for w in readings if w.role == "prefill")
    info = readings[worker].info
    readings[worker] = Reading(replace(info, identity=replace(info.identity, disaggregation_mode="decode")))
    judgement = judge_model(_config(), readings, startup=True)
    assert judgement.verdict == "refuse"
    assert any("disaggregation_mode 'decode'" in p for j in judgement.workers for p in j.problems)


def test_old_engine_warns_by_default_and_refuses_when_strict() -> None:
    assert judge_model(_config(), _readings(100_000, 100_000, version="0.5.8"), startup=True).verdict == "warn"
    strict = judge_model(_config(on_old_engine="refuse"), _readings(100_000, 100_000, version="0.5.8"), startup=True)
    assert strict.verdict == "refuse"


def test_after_startup_a_shrunken_worker_leaves_rotation_under_refuse() -> None:
    config = _config(prefill=[{"url": "http://p:1"}, {"url": "http://p:2"}])
    readings = _readings(100_000, 100_000)
    readings[Worker(WorkerSpec("http://p:2", "prefill"))] = Reading(_telemetry("prefill", 2048))
    judgement = judge_model(config, readings, startup=False)
    assert judgement.passes and judgement.effective_limit == 8185
    shrunk = next(j for j in judgement.workers if j.worker.url == "http://p:2")
    assert shrunk.problems


def test_identity_mismatch_is_refused() -> None:
    readings = _readings(100_000, 100_000)
    worker = next(w for w in readings if w.role == "decode")
    info = readings[worker].info
    readings[worker] = Reading(replace(info, identity=replace(info.identity, served_model_name="other-model")))
    judgement = judge_model(_config(), readings, startup=True)
    assert judgement.verdict == "refuse"


def test_versions_compare_numerically() -> None:
    assert version_tuple("0.5.8") < version_tuple("0.5.22") <= version_tuple("0.5.22.post1")


def test_a_verified_worker_that_misses_one_read_keeps_its_identity_which_still_bounds_the_limit() -> None:
    spec = _config(on_pool_mismatch="clamp")
    small, large = Worker(WorkerSpec("http://d1:1", "decode")), Worker(WorkerSpec("http://d2:1", "decode"))
    prefill = Worker(WorkerSpec("http://p:1", "prefill"))
    small.accept(_telemetry("decode", 4096).identity)
    readings = {prefill: Reading(_telemetry("prefill", 100_000)), small: Reading(None, "no answer in 5s"),
                large: Reading(_telemetry("decode", 100_000))}
    judgement = judge_model(spec, readings, startup=False)
    missed = next(j for j in judgement.workers if j.worker is small)
    assert not missed.problems and "not readable this time" in missed.warnings[0]
    assert judgement.effective_limit == 4096 - 512  # still the small pool's safe limit, not the large one's
    unverified = Worker(WorkerSpec("http://d3:1", "decode"))
    judgement = judge_model(spec, {**readings, unverified: Reading(None, "refused")}, startup=False)
    assert next(j for j in judgement.workers if j.worker is unverified).problems  # never verified: stays out
