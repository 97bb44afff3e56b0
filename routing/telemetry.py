"""Reading what an SGLang engine reports about itself: server info, effective context length, pool metric."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gateway.engines import EngineClient, EngineError
from routing.workers import WorkerTelemetry

_POOL_METRIC = re.compile(rb"^sglang:max_total_num_tokens(?:\{[^}]*\})?\s+([0-9.eE+]+)", re.MULTILINE)


@dataclass(slots=True)
class Reading:
    """One worker's telemetry, or why it could not be read."""

    telemetry: WorkerTelemetry | None
    error: str | None = None
    # `sglang:max_total_num_tokens` from /metrics, when the engine exports metrics (a cross-check).
    metrics_pool_tokens: int | None = None


async def read_worker(engines: EngineClient, url: str, *, timeout_s: float, with_metrics: bool) -> Reading:
    try:
        info = await _server_info(engines, url, timeout_s)
        models = await engines.get_json(url, "/v1/models", timeout_s=timeout_s)
    except EngineError as exc:
        return Reading(None, str(exc))
    try:
        telemetry = _parse(info, models)
    except (KeyError, TypeError, ValueError) as exc:
        return Reading(None, f"{url}: unusable server info ({exc!r})")
    pool_metric = await _metrics_pool(engines, url, timeout_s) if with_metrics else None
    return Reading(telemetry, metrics_pool_tokens=pool_metric)


async def _server_info(engines: EngineClient, url: str, timeout_s: float) -> Any:
    try:
        return await engines.get_json(url, "/server_info", timeout_s=timeout_s)
    except EngineError as exc:
        if exc.status != 404:
            raise
    return await engines.get_json(url, "/get_server_info", timeout_s=timeout_s)


def _parse(info: Any, models: Any) -> WorkerTelemetry:
    # /v1/models carries the effective context; server_info's context_length is null unless set at launch.
    model_entry = (models.get("data") or [{}])[0] if isinstance(models, dict) else {}
    context = model_entry.get("max_model_len") or info.get("context_length")
    return WorkerTelemetry(
        pool_tokens=int(info["max_total_num_tokens"]),
        max_req_input_len=int(info["max_req_input_len"]),
        context_length=int(context) if context is not None else None,
        page_size=int(info.get("page_size") or 1),
        version=str(info.get("version", "unknown")),
        disaggregation_mode=str(info.get("disaggregation_mode", "null")),
        served_model_name=info.get("served_model_name") or model_entry.get("id"),
        tokenizer_path=info.get("tokenizer_path"),
    )


async def _metrics_pool(engines: EngineClient, url: str, timeout_s: float) -> int | None:
    try:
        status, body = await engines.get(url, "/metrics", timeout_s=timeout_s)
    except EngineError:
        return None
    match = _POOL_METRIC.search(body) if status == 200 else None
    return int(float(match.group(1))) if match else None
