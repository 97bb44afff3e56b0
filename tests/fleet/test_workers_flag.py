"""`kvgate serve --workers 2`: two gateway processes accept on one port and, on Redis, join the fleet as two
replicas; SIGTERM to the parent stops both cleanly, and a parent killed outright takes them with it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from loadtests.engine.harness import start_pair
from tests.engine_records import wait_for
from tests.gateway_harness import ROOT, model_entry, write_config
from tests.redis_harness import redis_server


def test_two_worker_processes_share_one_port_and_one_fleet(tmp_path: Path) -> None:
    with redis_server(tmp_path) as redis, \
            start_pair(prefill_pool=50000, decode_pool=50000, context_length=8192, model="glm-5",
                       version="0.5.23") as pair:
        config = write_config(tmp_path, [model_entry("glm-5", [pair.prefill], [pair.decode])],
                              state={"backend": "redis", "redis_url": redis.url, "timeout_s": 1.0})
        url = f"http://127.0.0.1:{int(config.stem.split('-')[1])}"
        parent = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
                                   "--workers", "2", "--log-level", "warning"], cwd=ROOT,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            assert wait_for(lambda: redis.client().zcard("kvgate:replicas") == 2, timeout_s=60)
            assert wait_for(lambda: _ready(url), timeout_s=30)
            children = _children(parent.pid)
            assert len(children) == 2
            # Each in its own process group: a terminal's Ctrl-C reaches the parent only, which passes it on once.
            assert all(os.getpgid(pid) not in (parent.pid, os.getpgid(parent.pid)) for pid in children)
            body = {"text": "hello", "sampling_params": {"max_new_tokens": 2}}
            with ThreadPoolExecutor(16) as pool:
                statuses = list(pool.map(lambda _: httpx.post(url + "/generate", json=body, timeout=30).status_code,
                                         range(64)))
            assert statuses == [200] * 64
            parent.send_signal(signal.SIGTERM)
            assert parent.wait(timeout=30) == 0
            assert not [pid for pid in children if _alive(pid)]
        finally:
            if parent.poll() is None:
                parent.kill()


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_workers_whose_parent_is_killed_drain_and_exit_instead_of_holding_the_port(tmp_path: Path) -> None:
    with start_pair(prefill_pool=50000, decode_pool=50000, context_length=8192, model="glm-5",
                    version="0.5.23") as pair:
        config = write_config(tmp_path, [model_entry("glm-5", [pair.prefill], [pair.decode])])
        url = f"http://127.0.0.1:{int(config.stem.split('-')[1])}"
        parent = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
                                   "--workers", "2", "--log-level", "warning"], cwd=ROOT,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        children: list[int] = []
        try:
            assert wait_for(lambda: _ready(url), timeout_s=60)
            assert wait_for(lambda: len(_children(parent.pid)) == 2, timeout_s=30)
            children = _children(parent.pid)
            parent.kill()  # SIGKILL: nothing is passed on; the kernel tells the workers (PR_SET_PDEATHSIG)
            parent.wait(timeout=10)
            assert wait_for(lambda: not [pid for pid in children if _alive(pid)], timeout_s=20)
        finally:
            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
