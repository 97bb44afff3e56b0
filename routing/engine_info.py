"""Reading what an SGLang engine reports about itself: server info, effective context length, pool metric."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from routing.engines.client import EngineClient
from routing.engines.errors import EngineError, EngineRejected
from routing.engines.identity import EngineIdentity, parse_identity

_POOL_METRIC = re.compile(rb"^sglang:max_total_num_tokens(?:\{[^}]*\})?\s+([0-9.eE+]+)", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    identity: EngineIdentity
    context_length: int | None  # effective, from /v1/models (server info's is null unless set at launch)


@dataclass(frozen=True, slots=True)
class Reading:
    """One worker's telemetry, or why it could not be read."""

    info: EngineInfo | None
    error: str | None = None
    # `sglang:max_total_num_tokens` from /metrics, when the engine exports metrics (a cross-check).
    metrics_pool_tokens: int | None = None
    healthy: bool = True  # the configured health path answered 2xx (always, when it is /server_info)


async def read_worker(engines: EngineClient, url: str, *, timeout_s: float, with_metrics: bool,
                      health_path: str = "/server_info") -> Reading:
    try:
        server_info = await _server_info(engines, url, timeout_s)
        models = await engines.get_json(url, "/v1/models", timeout_s=timeout_s)
    except EngineError as exc:
        return Reading(None, str(exc))
    except ValueError as exc:  # an address that cannot be connected to at all (e.g. a bad port)
        return Reading(None, f"{url}: {exc}")
    try:
        info = EngineInfo(parse_identity(server_info), _effective_context(server_info, models))
    except (KeyError, TypeError, ValueError) as exc:
        return Reading(None, f"{url}: unusable server info ({exc!r})")
    pool_metric = await _metrics_pool(engines, url, timeout_s) if with_metrics else None
    healthy = health_path == "/server_info" or await _answers(engines, url, health_path, timeout_s)
    return Reading(info, metrics_pool_tokens=pool_metric, healthy=healthy)


async def _answers(engines: EngineClient, url: str, path: str, timeout_s: float) -> bool:
    try:
        status, _ = await engines.get(url, path, timeout_s=timeout_s)
    except EngineError:
        return False
    return 200 <= status < 300


async def _server_info(engines: EngineClient, url: str, timeout_s: float) -> Any:
    try:
        return await engines.get_json(url, "/server_info", timeout_s=timeout_s)
    except EngineRejected as exc:
        if exc.status != 404:
            raise
    return await engines.get_json(url, "/get_server_info", timeout_s=timeout_s)


def _effective_context(server_info: dict[str, Any], models: Any) -> int | None:
    entry = (models.get("data") or [{}])[0] if isinstance(models, dict) else {}
    context = (entry.get("max_model_len") if isinstance(entry, dict) else None) or server_info.get("context_length")
    return int(context) if context is not None else None


async def _metrics_pool(engines: EngineClient, url: str, timeout_s: float) -> int | None:
    try:
        status, body = await engines.get(url, "/metrics", timeout_s=timeout_s)
    except EngineError:
        return None
    # One series per data-parallel rank where the engine labels them: the smallest, as the gate takes.
    pools = [int(float(match.group(1))) for match in _POOL_METRIC.finditer(body)] if status == 200 else []
    return min(pools) if pools else None
