"""State behind a Sentinel-managed primary (Debian's redis-sentinel): the gateway finds the primary through the
Sentinels, rides out a failover (failing open meanwhile) and keeps its shared state on the promoted replica."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import redis as redis_py

from loadtests.engine.harness import free_port, start_pair
from tests.engine_records import wait_for
from tests.gateway_harness import model_entry, running_gateway, write_config
from tests.redis_harness import RedisServer

SERVICE = "kvgate-primary"


def _sentinel(directory: Path, primary_port: int) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    conf = directory / f"sentinel-{port}.conf"
    conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {directory}\n"
                    f"sentinel monitor {SERVICE} 127.0.0.1 {primary_port} 1\n"
                    f"sentinel down-after-milliseconds {SERVICE} 500\n"
                    f"sentinel failover-timeout {SERVICE} 3000\n")
    process = subprocess.Popen(["redis-sentinel", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    client = redis_py.Redis(port=port, socket_timeout=1)
    assert wait_for(lambda: _answers(client), timeout_s=10), "redis-sentinel did not start"
    return process, port


def _answers(client: redis_py.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis_py.RedisError:
        return False


def _replica_known(sentinel_port: int, replica_port: int) -> bool:
    try:
        known = redis_py.Redis(port=sentinel_port, socket_timeout=1).sentinel_slaves(SERVICE)
        link = redis_py.Redis(port=replica_port, socket_timeout=1).info("replication").get("master_link_status")
    except redis_py.RedisError:
        return False
    return link == "up" and any(int(r["port"]) == replica_port and "disconnected" not in r["flags"] for r in known)


def _primary_port(sentinel_port: int) -> int | None:
    try:
        host_port = redis_py.Redis(port=sentinel_port, socket_timeout=1).sentinel_get_master_addr_by_name(SERVICE)
    except redis_py.RedisError:
        return None
    return int(host_port[1]) if host_port else None


def test_a_sentinel_failover_is_survived_and_state_follows_the_new_primary(tmp_path: Path) -> None:
    if shutil.which("redis-sentinel") is None:
        pytest.fail("redis-sentinel is not installed (Debian: apt-get install redis-sentinel; .ci/run installs it)")
    primary = RedisServer(tmp_path).start()
    replica = RedisServer(tmp_path)
    replica_process = subprocess.Popen(
        ["redis-server", "--port", str(replica.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path), "--replicaof", "127.0.0.1", str(primary.port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    sentinel, sentinel_port = _sentinel(tmp_path, primary.port)
    try:
        assert wait_for(lambda: _answers(redis_py.Redis(port=replica.port, socket_timeout=1)), timeout_s=10)
        # Sentinel learns of replicas from the primary's INFO (every 10 s): a failover needs one it knows, in sync.
        assert wait_for(lambda: _replica_known(sentinel_port, replica.port), timeout_s=20), "replica not seen"
        with start_pair(prefill_pool=50000, decode_pool=50000, context_length=8192, model="glm-5",
                        version="0.5.23") as pair:
            config = write_config(tmp_path, [model_entry("glm-5", [pair.prefill], [pair.decode])],
                                  state={"backend": "redis", "redis_sentinels": [f"127.0.0.1:{sentinel_port}"],
                                         "redis_service": SERVICE, "on_redis_down": "open",
                                         "sync_interval_s": 0.1, "timeout_s": 1.0})
            with running_gateway(config) as gateway:
                def served() -> bool:
                    return httpx.post(gateway.url + "/generate", timeout=10, json={
                        "text": "hi", "sampling_params": {"max_new_tokens": 1}}).status_code == 200

                assert served()
                assert wait_for(lambda: primary.client().exists("kvgate:replicas") == 1, timeout_s=2)
                primary.stop()  # the primary dies: Sentinel promotes the replica
                assert served()  # open: served meanwhile
                assert wait_for(lambda: _primary_port(sentinel_port) == replica.port, timeout_s=15), "no failover"
                promoted = redis_py.Redis(port=replica.port, socket_timeout=1)
                # The gateway finds the new primary through Sentinel and writes its lease there.
                promoted.delete("kvgate:replicas")
                assert wait_for(lambda: promoted.exists("kvgate:replicas") == 1, timeout_s=5)
                assert served()
    finally:
        sentinel.kill()
        replica_process.kill()
        primary.stop()
