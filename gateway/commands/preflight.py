"""`kvgate preflight`: the KV-pool gate's checks against the running engines, without serving.

Exit status 0 only when every model passes (a configured clamp passes; it is reported).
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from gateway.config import GatewayConfig
from gateway.serving.models import dns_sources, health_spec, model_spec, ways_out
from routing.discovery import initial_specs, make_resolver
from routing.engines.client import EngineClient
from routing.gate import ModelJudgement
from routing.monitor import WorkerMonitor
from routing.pools import pool_for


async def collect(config: GatewayConfig) -> list[ModelJudgement]:
    engines = EngineClient(connect_timeout_s=config.timeouts.connect_s, verify_timeout_s=config.health.timeout_s,
                           abort_timeout_s=config.timeouts.abort_s)
    try:
        watched = []
        sources = dns_sources(config)
        found = await initial_specs(make_resolver(config.discovery.nameservers), sources) if sources else []
        for model in config.models:
            spec = model_spec(model)
            pool = pool_for(spec)
            for name, worker_spec in found:
                if name == model.name:
                    pool.add(pool.new_worker(worker_spec))
            watched.append((spec, pool, health_spec(config.health_of(model))))
        monitor = WorkerMonitor(engines, watched, lambda judgement, startup: None)
        return await monitor.verify_startup(config.gate.startup_timeout_s)
    finally:
        await engines.close()


def run_preflight(config: GatewayConfig, *, as_json: bool) -> int:
    judgements = asyncio.run(collect(config))
    print(orjson.dumps(report(judgements), option=orjson.OPT_INDENT_2).decode() if as_json else table(judgements))
    return 0 if _ok(judgements) else 1


def _ok(judgements: list[ModelJudgement]) -> bool:
    """Every model passes and no worker has a problem (unreachable, a pool mismatch, a check failed under refuse,
    or unverified where verified settings are required): a deploy pipeline stops on any of them."""
    return all(j.passes and not any(v.problems for v in j.workers) for j in judgements)


def report(judgements: list[ModelJudgement]) -> dict[str, Any]:
    models = []
    for judgement in judgements:
        workers = []
        for verdict in judgement.workers:
            info = verdict.reading.info
            identity = info.identity if info else None
            workers.append({
                "url": verdict.worker.url, "role": verdict.worker.role,
                "reported_mode": identity.disaggregation_mode if identity else None,
                "pool_tokens": identity.pool_tokens if identity else None,
                "max_req_input_len": identity.max_req_input_len if identity else None,
                "context_length": info.context_length if info else None,
                "page_size": identity.page_size if identity else None,
                "version": identity.version if identity else None,
                "verdict": verdict.verdict, "problems": verdict.problems, "warnings": verdict.warnings,
                "checks": [{"check": c.check, "result": c.result, "value": c.value, "safe": c.safe,
                            "policy": c.policy} for c in verdict.checks],
            })
        models.append({"model": judgement.model.name, "context_length": judgement.model.context_length,
                       "advertised_prompt_limit": judgement.configured_limit,
                       "effective_prompt_limit": judgement.effective_limit,
                       "decode_pool_tokens": judgement.decode_pool_tokens,
                       "policy": judgement.model.on_pool_mismatch, "verdict": judgement.verdict,
                       "reasons": judgement.reasons, "ways_out": ways_out(judgement), "workers": workers})
    return {"ok": _ok(judgements), "models": models}


def table(judgements: list[ModelJudgement]) -> str:
    data = report(judgements)
    lines = []
    header = ("ROLE", "WORKER", "POOL", "MAX_REQ_INPUT", "CONTEXT", "PAGE", "VERSION", "VERDICT")
    for model in data["models"]:
        rows = [header] + [(w["role"], w["url"], _cell(w["pool_tokens"]), _cell(w["max_req_input_len"]),
                            _cell(w["context_length"]), _cell(w["page_size"]), _cell(w["version"]),
                            w["verdict"].upper()) for w in model["workers"]]
        lines.append(f"model {model['model']}: advertised {model['advertised_prompt_limit']} prompt tokens "
                     f"(context {model['context_length']}), effective {model['effective_prompt_limit']}, "
                     f"policy {model['policy']} -> {model['verdict'].upper()}")
        lines.extend(_aligned(rows))
        checks = [("ROLE", "WORKER", "CHECK", "RESULT", "VALUE", "SAFE")] + [
            (w["role"], w["url"], c["check"], _result_cell(c, w), c["value"], c["safe"])
            for w in model["workers"] for c in w["checks"]]
        if len(checks) > 1:
            lines.append("  deployment checks:")
            lines.extend("  " + line for line in _aligned(checks))
        for worker in model["workers"]:
            check_texts = {f"{c['check']}: " for c in worker["checks"]}
            for note in worker["problems"] + worker["warnings"]:
                if not any(note.startswith(prefix) for prefix in check_texts):  # already in the checks table
                    lines.append(f"  ! {worker['url']}: {note}")
        lines.extend(f"  => {reason}" for reason in model["reasons"])
        lines.extend(f"  => {line}" for line in model["ways_out"])
        lines.append("")
    lines.append("PASS: every model fits its engines' KV pools and passes the deployment checks" if data["ok"]
                 else "FAIL: see the models above")
    return "\n".join(lines)


def _result_cell(check: dict[str, Any], worker: dict[str, Any]) -> str:
    """FAIL (refuse|warn), UNVERIFIED (required) when that fails the worker, else the result."""
    result = check["result"].upper()
    if check["result"] == "fail":
        return f"{result} ({check['policy']})"
    if check["result"] == "unverified" and any(p.startswith(check["check"] + ":") and p.endswith("required")
                                               for p in worker["problems"]):
        return f"{result} (required)"
    return str(result)


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows]


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)
