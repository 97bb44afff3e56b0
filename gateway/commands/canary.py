"""`kvgate canary --config FILE`: the gateway started in-process (the KV-pool gate runs as at startup), then every
model probed through its own routes, admission and dispatch (gateway.serving.canary). Exit 1 on any leak or any
over-limit prompt admitted, 0 otherwise."""

from __future__ import annotations

import asyncio

import httpx

from gateway.config import GatewayConfig
from gateway.http.app import create_app
from gateway.serving.canary import CanaryReport, probe_model
from gateway.serving.gateway import GateRefused, Gateway


async def probe(config: GatewayConfig) -> CanaryReport:
    gateway = Gateway(config)
    app = create_app(config, gateway)
    await gateway.start()
    report = CanaryReport()
    try:
        transport = httpx.ASGITransport(app=app)  # the gateway's own routes, admission and dispatch; no socket
        async with httpx.AsyncClient(transport=transport, base_url="http://kvgate", timeout=120) as client:
            for model in gateway.models.values():
                await probe_model(client, model, report)
    finally:
        await gateway.stop()
    return report


def run_canary(config: GatewayConfig) -> int:
    try:
        report = asyncio.run(probe(config))
    except GateRefused as refused:
        print(f"canary: not run, the KV-pool gate refused:\n{refused}")
        return 1
    print(report.text())
    return 1 if report.leaks else 0
