"""`kvgate serve` replicas in their own processes, sharing one real redis-server, for the fleet tests that need
real parallelism between replicas (each replica its own event loop and its own Redis connections)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from loadtests.engine.harness import EnginePair
from tests.engine_records import wait_for
from tests.gateway_harness import ROOT, model_entry, write_config

ADMIN_TOKEN = "fleet-admin-token"


def hashed(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


@dataclass
class Replica:
    url: str
    process: subprocess.Popen[str]

    def admin(self, path: str) -> httpx.Response:
        return httpx.post(self.url + path, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)

    def in_flight(self) -> int:
        """Requests this replica has on its decode workers (0 once every exchange closed and its pass is back)."""
        workers = httpx.get(self.url + "/admin/workers", headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
                            timeout=10).json()["workers"]
        return sum(int(w["in_flight"]) for w in workers if w["role"] == "decode")


R = TypeVar("R", bound=Replica)


@contextmanager
def replicas(directory: Path, pair: EnginePair, count: int, *, state: dict[str, Any],
             tenants: list[dict[str, Any]], routing: dict[str, Any] | None = None,
             kind: type[R] = Replica) -> Iterator[list[R]]:  # type: ignore[assignment]
    env = {**os.environ, "KVGATE_ADMIN_TOKEN": ADMIN_TOKEN}
    started: list[R] = []
    model = model_entry("glm-5", [pair.prefill], [pair.decode], **({"routing": routing} if routing else {}))
    try:
        for _ in range(count):
            config = write_config(directory, [model], state={"backend": "redis", **state}, auth={"required": True},
                                  tenants=tenants)
            port = int(config.stem.split("-")[1])
            process = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
                                        "--log-level", "warning"], cwd=ROOT, env=env, text=True,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            started.append(kind(f"http://127.0.0.1:{port}", process))
        for replica in started:
            assert wait_for(lambda r=replica: _ready(r.url), timeout_s=60), "a replica did not start"
        yield started
    finally:
        for replica in started:
            if replica.process.poll() is None:
                replica.process.terminate()
        for replica in started:
            try:
                replica.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                replica.process.kill()


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def chat(text: str, max_tokens: int = 1, stream: bool = False) -> dict[str, object]:
    return {"model": "glm-5", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "stream": stream, "ignore_eos": True}
