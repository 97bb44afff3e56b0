"""The KV-pool contract: a model's prompt limit must fit what every one of its running engines safely admits.

SGLang's scheduler aborts any prompt with L >= max_req_input_len, and in PD mode that abort is the path that leaked
other tenants' KV pages; so the largest prompt a worker safely admits is `max_req_input_len - 1`. This module judges
readings (pure functions, no I/O): which workers may receive traffic, the model's effective limit, and why.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from gateway.config import ModelConfig
from routing.telemetry import Reading
from routing.workers import Worker

Verdict = Literal["pass", "warn", "clamp", "refuse"]


@dataclass(slots=True)
class WorkerJudgement:
    worker: Worker
    reading: Reading
    problems: list[str] = field(default_factory=list)   # any problem keeps the worker out of rotation
    warnings: list[str] = field(default_factory=list)
    pool_mismatch: bool = False

    @property
    def verdict(self) -> Verdict:
        if self.problems:
            return "refuse"
        return "warn" if self.warnings else "pass"


@dataclass(slots=True)
class ModelJudgement:
    config: ModelConfig
    workers: list[WorkerJudgement]
    configured_limit: int
    effective_limit: int
    decode_pool_tokens: int | None
    verdict: Verdict
    reasons: list[str]

    @property
    def passes(self) -> bool:
        return self.verdict != "refuse"


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def judge_model(config: ModelConfig, readings: dict[Worker, Reading], *, startup: bool) -> ModelJudgement:
    """Judge every worker of a model and derive the model's limits.

    At startup a pool mismatch under `refuse` refuses the whole model; afterwards it only takes the offending
    worker out of rotation, so a pool that shrinks never lowers the promise silently.
    """
    configured = config.configured_prompt_limit
    judgements = [_judge_worker(config, worker, reading, configured) for worker, reading in readings.items()]
    _check_identity(judgements)
    reasons: list[str] = []
    mismatches = [j for j in judgements if j.pool_mismatch]
    if config.on_pool_mismatch == "refuse":
        for judgement in mismatches:
            judgement.problems.append(_mismatch_text(judgement, configured))
    # Safety first, whatever the policy: never admit a prompt some admitted worker's scheduler would abort.
    admitted_limits = [j.reading.telemetry.max_req_input_len - 1 for j in judgements
                       if not j.problems and j.reading.telemetry is not None]
    effective = min([configured, *admitted_limits])
    if mismatches and config.on_pool_mismatch == "clamp":
        reasons.append(f"clamped from {configured} to {effective} prompt tokens: "
                       + "; ".join(_mismatch_text(j, configured) for j in mismatches))
    admitted = [j for j in judgements if not j.problems]
    for role in ("prefill", "decode"):
        if not any(j.worker.role == role for j in admitted):
            failing = [f"{j.worker.url}: {'; '.join(j.problems)}" for j in judgements if j.worker.role == role]
            reasons.append(f"no usable {role} worker ({' | '.join(failing) or 'none configured'})")
    if startup and mismatches and config.on_pool_mismatch == "refuse":
        reasons.insert(0, "; ".join(_mismatch_text(j, configured) for j in mismatches))
        verdict: Verdict = "refuse"
    elif any(r.startswith("no usable") for r in reasons):
        verdict = "refuse"
    elif mismatches and config.on_pool_mismatch == "clamp":
        verdict = "clamp"
    else:
        verdict = "warn" if any(j.warnings or j.problems for j in judgements) else "pass"
    decode_pools = [j.reading.telemetry.pool_tokens for j in admitted
                    if j.worker.role == "decode" and j.reading.telemetry is not None]
    return ModelJudgement(config, judgements, configured, effective, min(decode_pools) if decode_pools else None,
                          verdict, reasons)


def _judge_worker(config: ModelConfig, worker: Worker, reading: Reading, configured: int) -> WorkerJudgement:
    judgement = WorkerJudgement(worker, reading)
    telemetry = reading.telemetry
    if telemetry is None:
        judgement.problems.append(f"unreachable: {reading.error}")
        return judgement
    if telemetry.disaggregation_mode != worker.role:
        judgement.problems.append(f"listed as {worker.role} but reports disaggregation_mode "
                                  f"{telemetry.disaggregation_mode!r}")
    if version_tuple(telemetry.version) < version_tuple(config.min_engine_version):
        text = (f"engine version {telemetry.version} is older than {config.min_engine_version} "
                "(no upstream admission fix for over-long prompts in PD mode)")
        (judgement.problems if config.on_old_engine == "refuse" else judgement.warnings).append(text)
    if reading.metrics_pool_tokens is not None and reading.metrics_pool_tokens != telemetry.pool_tokens:
        judgement.warnings.append(f"/metrics reports a pool of {reading.metrics_pool_tokens} tokens, server info "
                                  f"{telemetry.pool_tokens}")
    if telemetry.context_length is not None and telemetry.context_length < config.context_length:
        judgement.warnings.append(f"engine context length {telemetry.context_length} is below the advertised "
                                  f"{config.context_length}")
    # SGLang's max_req_len = min(context - 1, pool - 1) is what the engine holds; its scheduler then keeps 5 more
    # tokens back. A limit within that reserve is lowered silently; a limit beyond what the pool holds is a mismatch.
    judgement.pool_mismatch = telemetry.max_req_input_len + 5 < configured
    return judgement


def _check_identity(judgements: list[WorkerJudgement]) -> None:
    """Every worker of a model must serve the same model with the same tokenizer as the first one that answered."""
    reference = next((j.reading.telemetry for j in judgements if j.reading.telemetry is not None), None)
    if reference is None:
        return
    for judgement in judgements:
        telemetry = judgement.reading.telemetry
        if telemetry is None:
            continue
        if telemetry.served_model_name != reference.served_model_name:
            judgement.problems.append(f"serves {telemetry.served_model_name!r}, other workers serve "
                                      f"{reference.served_model_name!r}")
        if telemetry.tokenizer_path != reference.tokenizer_path:
            judgement.problems.append(f"tokenizer {telemetry.tokenizer_path!r} differs from the other workers' "
                                      f"{reference.tokenizer_path!r}")


def _mismatch_text(judgement: WorkerJudgement, configured: int) -> str:
    telemetry = judgement.reading.telemetry
    assert telemetry is not None
    return (f"{judgement.worker.role} worker {judgement.worker.url} has a KV pool of {telemetry.pool_tokens} tokens "
            f"(max_req_input_len {telemetry.max_req_input_len}, safe prompt limit {telemetry.max_req_input_len - 1})"
            f", below the model's limit of {configured} prompt tokens")
