"""`bin/demo` (README's main job): `kvgate demo` with its embedded default config starts the emulated engines and
serves in front of them, the advertised limit clamped to what the pools hold. Run on free ports (a copy of the
default config), over real HTTP."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.commands.demo import DEMO_CONFIG
from loadtests.engine.harness import free_port
from loadtests.procstat import REPO_ROOT, stop_process

pytestmark = pytest.mark.long_running(seconds=20)


def test_the_default_demo_config_is_the_checkouts_own() -> None:
    assert DEMO_CONFIG == REPO_ROOT / "config" / "demo.yaml" and DEMO_CONFIG.is_file()


def test_kvgate_demo_serves_chat_with_the_limit_its_pools_hold(tmp_path: Path) -> None:
    document = yaml.safe_load(DEMO_CONFIG.read_text())
    port = free_port()
    document["listen"]["port"] = port
    model = document["models"][0]
    for worker in model["prefill"]:
        worker["url"], worker["bootstrap_port"] = f"http://127.0.0.1:{free_port()}", free_port()
    for worker in model["decode"]:
        worker["url"] = f"http://127.0.0.1:{free_port()}"
    config = tmp_path / "demo.yaml"
    config.write_text(yaml.safe_dump(document))
    demo = subprocess.Popen([sys.executable, "-m", "gateway.cli", "demo", "--config", str(config)], cwd=REPO_ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert demo.poll() is None, demo.stderr.read() if demo.stderr else ""
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "kvgate demo did not become ready"
            time.sleep(0.3)
        (entry,) = httpx.get(url + "/v1/models", timeout=10).json()["data"]
        assert entry["max_model_len"] == 1_048_576 and entry["max_prompt_tokens"] < 681_280  # clamped to the pools
        answer = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "model": "glm-5", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["prompt_tokens"] == int(answer.headers["x-kvgate-prompt-tokens"])
    finally:
        stop_process(demo)
