"""The KV-pool contract: a model's prompt limit must fit what every one of its running engines safely admits.

SGLang's scheduler aborts any prompt with L >= max_req_input_len, and in PD mode that abort is the path that leaked
other tenants' KV pages; so the largest prompt a worker safely admits is `max_req_input_len - 1`. This module judges
readings (pure functions, no I/O): which workers may receive traffic, the model's effective limit, and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from routing.deployment_checks import TRANSFER_SETTINGS, CheckOutcome, check_worker
from routing.engine_info import Reading
from routing.engines.identity import EngineIdentity, version_tuple
from routing.specs import ModelSpec
from routing.workers import Worker

Verdict = Literal["pass", "warn", "clamp", "refuse"]


@dataclass(slots=True)
class WorkerJudgement:
    worker: Worker
    reading: Reading
    problems: list[str] = field(default_factory=list)   # any problem keeps the worker out of rotation
    warnings: list[str] = field(default_factory=list)
    pool_mismatch: bool = False
    checks: list[CheckOutcome] = field(default_factory=list)  # the deployment checks (routing.deployment_checks)

    @property
    def verdict(self) -> Verdict:
        if self.problems:
            return "refuse"
        return "warn" if self.warnings else "pass"


@dataclass(slots=True)
class ModelJudgement:
    model: ModelSpec
    workers: list[WorkerJudgement]
    configured_limit: int
    effective_limit: int
    decode_pool_tokens: int | None
    verdict: Verdict
    reasons: list[str]

    @property
    def passes(self) -> bool:
        return self.verdict != "refuse"


def judge_model(model: ModelSpec, readings: dict[Worker, Reading], *, startup: bool) -> ModelJudgement:
    """Judge every worker of a model and derive the model's limits.

    At startup a pool mismatch under `refuse` refuses the whole model; afterwards it only takes the offending
    worker out of rotation, so a pool that shrinks never lowers the promise silently.
    """
    configured = model.configured_prompt_limit
    judgements = [_judge_worker(model, worker, reading, configured, startup=startup)
                  for worker, reading in readings.items()]
    _check_same_model(judgements)
    _check_deployment(model, judgements)
    reasons: list[str] = []
    mismatches = [j for j in judgements if j.pool_mismatch]
    if model.on_pool_mismatch == "refuse":
        for judgement in mismatches:
            judgement.problems.append(mismatch_text(judgement, configured))
    # Safety first, whatever the policy: never admit a prompt some admitted worker would abort or never schedule.
    admitted_limits = [safe_prompt_limit(j.worker.role, identity) for j in judgements
                       if not j.problems and (identity := _identity(j)) is not None]
    effective = min([configured, *admitted_limits])
    if mismatches and model.on_pool_mismatch == "clamp":
        reasons.append(f"clamped from {configured} to {effective} prompt tokens: "
                       + "; ".join(mismatch_text(j, configured, name_worker=True) for j in mismatches))
    admitted = [j for j in judgements if not j.problems]
    # Model-level reasons name no worker detail: each worker's own problems carry it, once.
    for role in ("prefill", "decode"):
        if not any(j.worker.role == role for j in admitted):
            configured_any = any(j.worker.role == role for j in judgements)
            reasons.append(f"no usable {role} worker" + ("" if configured_any else " (none configured)"))
    if startup and mismatches and model.on_pool_mismatch == "refuse":
        reasons.insert(0, f"{len(mismatches)} worker(s) hold less than the advertised {configured} prompt tokens")
        verdict: Verdict = "refuse"
    elif any(r.startswith("no usable") for r in reasons):
        verdict = "refuse"
    elif mismatches and model.on_pool_mismatch == "clamp":
        verdict = "clamp"
    else:
        verdict = "warn" if any(j.warnings or j.problems for j in judgements) else "pass"
    decode_pools = [identity.pool_tokens for j in admitted
                    if j.worker.role == "decode" and (identity := _identity(j)) is not None]
    return ModelJudgement(model, judgements, configured, effective, min(decode_pools) if decode_pools else None,
                          verdict, reasons)


def _identity(judgement: WorkerJudgement) -> EngineIdentity | None:
    """What the worker's limits are judged by: this reading, or the identity last verified when it was not read."""
    return judgement.reading.info.identity if judgement.reading.info is not None else judgement.worker.verified


def _judge_worker(model: ModelSpec, worker: Worker, reading: Reading, configured: int, *,
                  startup: bool) -> WorkerJudgement:
    judgement = WorkerJudgement(worker, reading)
    if reading.info is None:
        if not startup and worker.verified is not None:
            # One missed read is the health checks' to judge (thresholds); the worker keeps the identity the gate
            # verified, which still bounds the model's limit, and every new connection must still confirm it.
            judgement.warnings.append(f"not readable this time: {reading.error}")
        else:
            judgement.problems.append(f"unreachable: {reading.error}")
        return judgement
    identity, context_length = reading.info.identity, reading.info.context_length
    if identity.disaggregation_mode != worker.role:
        judgement.problems.append(f"listed as {worker.role} but reports disaggregation_mode "
                                  f"{identity.disaggregation_mode!r}")
    if version_tuple(identity.version) < version_tuple(model.min_engine_version):
        text = (f"engine version {identity.version} is older than {model.min_engine_version} "
                "(no upstream admission fix for over-long prompts in PD mode)")
        (judgement.problems if model.on_old_engine == "refuse" else judgement.warnings).append(text)
    if reading.metrics_pool_tokens is not None \
            and reading.metrics_pool_tokens not in (identity.pool_tokens, identity.rank0_pool_tokens):
        # (a /metrics that exports rank 0 alone agrees when it reports rank 0's pool)
        judgement.warnings.append(f"/metrics reports a pool of {reading.metrics_pool_tokens} tokens, server info "
                                  f"{identity.pool_tokens}")
    if context_length is not None and context_length < model.context_length:
        judgement.warnings.append(f"engine context length {context_length} is below the advertised "
                                  f"{model.context_length}")
    # SGLang's max_req_len = min(context - 1, pool - 1) is what the engine holds; its scheduler then keeps 5 more
    # tokens back. A limit within that reserve is lowered silently; a limit beyond what the pool holds is a mismatch,
    # and so is a decode pool that cannot hold the limit plus the tokens its prealloc queue reserves for decoding.
    judgement.pool_mismatch = identity.max_req_input_len + 5 < configured or (
        worker.role == "decode" and identity.pool_tokens - identity.reserved_decode_tokens < configured)
    return judgement


def safe_prompt_limit(role: str, identity: EngineIdentity) -> int:
    """The longest prompt a worker safely takes: below the scheduler's abort threshold (the path that leaked), and
    on a decode short enough that prompt + reserved decode tokens fit its pool (else its prealloc queue never
    schedules it and every request behind it waits: sglang disaggregation/decode.py, DecodePreallocQueue)."""
    limit = identity.max_req_input_len - 1
    if role == "decode":
        limit = min(limit, identity.pool_tokens - identity.reserved_decode_tokens)
    return limit


def _check_deployment(model: ModelSpec, judgements: list[WorkerJudgement]) -> None:
    """The transfer-safety and version checks, each worker against the model's workers of the other role."""
    identities = [(j, _identity(j)) for j in judgements]
    fleet = [i for _, i in identities if i is not None]
    policy = model.checks
    for judgement, identity in identities:
        if identity is None:
            continue
        judgement.checks = check_worker(judgement.worker.role, identity, fleet, policy)
        for outcome in judgement.checks:
            if outcome.result == "fail":
                (judgement.problems if outcome.policy == "refuse" else judgement.warnings).append(outcome.text())
            elif outcome.result == "unverified" and outcome.check in TRANSFER_SETTINGS \
                    and policy.require_verified_transfer_settings:
                judgement.problems.append(outcome.text() + " — verified transfer settings are required")


def _check_same_model(judgements: list[WorkerJudgement]) -> None:
    """Every worker of a model must serve the same model with the same tokenizer as the first one that answered."""
    reference = next((j.reading.info.identity for j in judgements if j.reading.info is not None), None)
    if reference is None:
        return
    for judgement in judgements:
        if judgement.reading.info is None:
            continue
        identity = judgement.reading.info.identity
        if identity.served_model_name != reference.served_model_name:
            judgement.problems.append(f"serves {identity.served_model_name!r}, other workers serve "
                                      f"{reference.served_model_name!r}")
        if identity.tokenizer_path != reference.tokenizer_path:
            judgement.problems.append(f"tokenizer {identity.tokenizer_path!r} differs from the other workers' "
                                      f"{reference.tokenizer_path!r}")


def mismatch_text(judgement: WorkerJudgement, configured: int, *, name_worker: bool = False) -> str:
    assert judgement.reading.info is not None
    identity = judgement.reading.info.identity
    who = f"{judgement.worker.role} worker {judgement.worker.url}: " if name_worker else ""
    reserve = (f", {identity.reserved_decode_tokens} reserved for decoding"
               if judgement.worker.role == "decode" else "")
    return (f"{who}KV pool of {identity.pool_tokens} tokens (max_req_input_len {identity.max_req_input_len}{reserve}, "
            f"safe prompt limit {safe_prompt_limit(judgement.worker.role, identity)}) is below the model's limit of "
            f"{configured} prompt tokens")


def safe_limit(judgement: ModelJudgement) -> int | None:
    """The largest limit every mismatched worker safely admits (what clamping would serve), if any mismatch."""
    limits = [safe_prompt_limit(j.worker.role, j.reading.info.identity) for j in judgement.workers
              if j.pool_mismatch and j.reading.info is not None]
    return min(limits) if limits else None
