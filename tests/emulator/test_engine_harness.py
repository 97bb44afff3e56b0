"""The harness: one engine started, restarted on the same ports with a smaller pool, stopped cleanly."""

from __future__ import annotations

import json
import os
import urllib.request

from loadtests.engine.harness import start_engine

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _info(url: str) -> dict:
    with urllib.request.urlopen(url + "/server_info", timeout=5) as r:
        return json.loads(r.read())


def test_restart_keeps_ports_and_applies_new_options() -> None:
    eng = start_engine("decode", pool_tokens=4096, context_length=8192, health_delay_s=0)
    try:
        port = eng.port
        assert eng.ready_line.startswith("kvgate-engine ready role=decode")
        assert _info(eng.url)["max_total_num_tokens"] == 4096
        eng.restart(pool_tokens=1024, bug=False)
        assert eng.port == port
        info = _info(eng.url)
        assert info["max_total_num_tokens"] == 1024 and info["max_req_input_len"] == 1018
    finally:
        assert eng.stop() == 0  # SIGTERM exits cleanly
