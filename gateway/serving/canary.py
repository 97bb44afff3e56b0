"""The canary: probe tenant isolation through the gateway's own admission and dispatch path.

For each model it sends a probe carrying a unique random marker, then prompts of exactly limit−1, limit, limit+1,
2×limit and pool+1 tokens (token ids, so the size is exact), and checks that (a) no answer contains any marker — an
answer that does is another request's KV, the incident's leak — and (b) every prompt over the limit was refused with
413. Exit 1 on any leak or any over-limit prompt admitted, 0 otherwise. Probes are small (a few output tokens) and
carry the process's probe token (gateway.integrity.probe), which keeps them out of tenant accounting.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import orjson

from gateway.integrity.probe import PROBE_HEADER, PROBE_TOKEN
from gateway.serving.models import ServedModel

if TYPE_CHECKING:
    from gateway.serving.gateway import Gateway

log = logging.getLogger("kvgate.canary")
_PROBE_HEADERS = {PROBE_HEADER: PROBE_TOKEN}
_OUTPUT_TOKENS = 16
_MARKER_PREFIX = "CANARY-"


@dataclass
class ProbeResult:
    model: str
    name: str
    prompt_tokens: int
    status: int
    leaked: bool
    admitted_over_limit: bool


@dataclass
class CanaryReport:
    probes: list[ProbeResult] = field(default_factory=list)

    @property
    def leaks(self) -> list[ProbeResult]:
        return [p for p in self.probes if p.leaked or p.admitted_over_limit]

    def text(self) -> str:
        lines = [f"{p.model:12s} {p.name:10s} {p.prompt_tokens:>9d} tokens -> {p.status}"
                 + ("  LEAK: an earlier probe's marker in the answer" if p.leaked else "")
                 + ("  ADMITTED OVER THE LIMIT" if p.admitted_over_limit else "") for p in self.probes]
        lines.append(f"canary: {len(self.probes)} probes, {len(self.leaks)} failures"
                     + (" — tenant isolation is BROKEN" if self.leaks else " — no leak"))
        return "\n".join(lines)


async def probe_model(client: httpx.AsyncClient, model: ServedModel, report: CanaryReport, *,
                       near_limit: bool = True) -> None:
    """Markers, then the sizes around the limit (`near_limit=False`: only those that must be refused, which cost
    the engines nothing — what a background prober can afford on every interval)."""
    markers = [f"{_MARKER_PREFIX}{secrets.token_hex(8)}" for _ in range(2)]
    limit = model.admission.limits.prompt_tokens
    pools = [w.verified.pool_tokens for w in model.pool.workers if w.verified is not None]
    filler = model.admission.tokenizer.tokenizer.encode("lorem", add_special_tokens=False).ids[0]
    sizes = {"limit-1": limit - 1, "limit": limit} if near_limit else {}
    sizes.update({"limit+1": limit + 1, "2xlimit": 2 * limit})
    if pools:
        sizes["pool+1"] = min(pools) + 1
    for marker in markers:  # the secrets a leak would carry, from their first token on
        await _send(client, model, report, "marker", {"text": f"{marker} " * 8}, markers, limit)
    for name, size in sizes.items():
        await _send(client, model, report, name, {"input_ids": [filler] * max(1, size)}, markers, limit)


async def _send(client: httpx.AsyncClient, model: ServedModel, report: CanaryReport, name: str,
                prompt: dict[str, Any], markers: list[str], limit: int) -> None:
    limits = model.admission.limits
    size_hint = len(prompt.get("input_ids", ()))
    room = min(limits.context_length - 1 - size_hint,
               (limits.decode_pool_tokens or limits.context_length) - size_hint)
    # A prompt at the limit leaves little room for output: ask for what fits, so it is served, not refused.
    body = {**prompt, "model": model.name, "sampling_params": {"max_new_tokens": max(1, min(_OUTPUT_TOKENS, room))}}
    response = await client.post("/generate", content=orjson.dumps(body),
                                 headers={"content-type": "application/json", **_PROBE_HEADERS})
    size = len(prompt["input_ids"]) if "input_ids" in prompt else int(response.headers.get("x-kvgate-prompt-tokens",
                                                                                              0))
    text = ""
    if response.status_code == 200:
        answer = response.json()
        text = str(answer.get("text", ""))
    # Near the limit an answer may be only a few tokens long, starting mid-marker: a marker's tail with the first hex
    # digits of its random part is another request's KV.
    leaked = name != "marker" and any(f"ARY-{marker[len(_MARKER_PREFIX):][:2]}" in text for marker in markers)
    report.probes.append(ProbeResult(model.name, name, size, response.status_code, leaked,
                                     admitted_over_limit=size > limit and response.status_code == 200))


class CanaryProber:
    """The canary on a schedule, inside a running gateway (per model `integrity.canary_interval_s`): results as
    `kvgate_canary_probes_total{result}` and `kvgate_canary_leaks_total`."""

    def __init__(self, gateway: Gateway, app: Any) -> None:
        self._gateway = gateway
        self._app = app
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run(name), name=f"kvgate-canary-{name}")
                       for name, model in self._gateway.models.items()
                       if model.config.integrity.canary_interval_s is not None]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run(self, name: str) -> None:
        transport = httpx.ASGITransport(app=self._app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvgate", timeout=120) as client:
            while True:
                model = self._gateway.models[name]  # looked up each time: a reload may change its settings
                rule = model.config.integrity
                await asyncio.sleep(rule.canary_interval_s or 60.0)
                if rule.canary_interval_s is None or model.unavailable or self._gateway.shutting_down:
                    continue
                report = CanaryReport()
                try:
                    await probe_model(client, model, report, near_limit=rule.canary_near_limit)
                except Exception as exc:  # the prober must outlive any one bad round
                    self._gateway.metrics.canary_probes.labels(name, "error").inc()
                    log.warning("canary probe of %s failed: %r", name, exc)
                    continue
                metrics = self._gateway.metrics
                for result in report.probes:
                    outcome = "leak" if result.leaked else "admitted_over_limit" if result.admitted_over_limit \
                        else str(result.status)
                    metrics.canary_probes.labels(model.name, outcome).inc()
                if report.leaks:
                    metrics.canary_leaks.labels(model.name).inc(len(report.leaks))
                    log.error("canary: model %s failed %d probe(s):\n%s", model.name, len(report.leaks),
                              report.text())
