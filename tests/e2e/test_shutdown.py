"""SIGHUP reloads the configuration; SIGTERM drains: /readyz turns 503 and new requests get 503 while streams in flight finish within the grace
period; those still running at its end are cancelled on both halves, in the safe order. `kvgate serve` runs as a
process, because only the main thread receives signals."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from loadtests.engine.harness import start_pair
from tests.engine_records import generation_records, wait_for
from tests.gateway_harness import ROOT, model_entry, write_config

SHORT, LONG = 8, 400  # output tokens at 50 ms each: 0.4 s, well inside the grace; 20 s, far beyond it
GRACE_S = 3.0


def test_sighup_reloads_then_sigterm_lets_streams_that_fit_the_grace_finish_and_cancels_the_rest_on_both_halves(tmp_path: Path) -> None:
    with start_pair(prefill_pool=50000, decode_pool=50000, context_length=8192, model="glm-5", version="0.5.23",
                    token_delay_ms=50) as pair:
        config = write_config(tmp_path, [model_entry("glm-5", [pair.prefill], [pair.decode])],
                              shutdown={"grace_s": GRACE_S}, logging={"format": "json"})
        port = int(config.stem.split("-")[1])
        url = f"http://127.0.0.1:{port}"
        process = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
                                    "--log-level", "info"], cwd=ROOT, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        try:
            assert wait_for(lambda: _ready(url), timeout_s=30), "gateway did not start"
            document = yaml.safe_load(config.read_text())
            document["models"][0]["max_prompt_tokens"] = 100
            config.write_text(yaml.safe_dump(document))
            process.send_signal(signal.SIGHUP)  # re-read the file: the new limit applies, nothing restarts
            assert wait_for(lambda: _served_limit(url) == 100, timeout_s=10)
            outcome = asyncio.run(_streams_across_a_sigterm(url, process))
            assert process.wait(timeout=30) == 0
        finally:
            if process.poll() is None:
                process.kill()
        output = process.stdout.read() if process.stdout else ""
        short, long_, during = outcome
        assert all(body.endswith(b"data: [DONE]\n\n") for body in short), "a stream that fit the grace was cut"
        assert all(b"shutting_down" in body and b"[DONE]" not in body for body in long_)
        assert during == (503, 503)  # /readyz and a new request, while draining
        decode = {r["rid"]: r for r in generation_records(pair.decode)}
        cut = [r for r in decode.values() if r["completion_tokens"] < LONG and r["outcome"] != "finished"]
        assert len(cut) == 10 and all(r["outcome"] in ("aborted", "client_disconnected") for r in cut)
        assert wait_for(lambda: httpx.get(pair.decode.url + "/emu/state").json()["used_tokens"] == 0, timeout_s=5)
        assert "Traceback" not in output
        lines = [json.loads(line) for line in output.splitlines() if line.strip()]  # every line is JSON
        access = [line for line in lines if line["logger"] == "kvgate.access"]
        assert len(access) == 21 and all(line["request_id"] and line["status"] for line in access)  # 20 + the 503


def _served_limit(url: str) -> int:
    return int(httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["max_prompt_tokens"])


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


async def _streams_across_a_sigterm(url: str, process: subprocess.Popen[str]) -> tuple[list[bytes], list[bytes],
                                                                                       tuple[int, int]]:
    started: list[asyncio.Event] = []

    async def stream(client: httpx.AsyncClient, tokens: int) -> bytes:
        body = {"text": "Count slowly.", "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
                "stream": True}
        first = asyncio.Event()
        started.append(first)
        chunks = []
        async with client.stream("POST", url + "/generate", json=body) as response:
            assert response.status_code == 200
            async for chunk in response.aiter_bytes():
                first.set()
                chunks.append(chunk)
        return b"".join(chunks)

    async with httpx.AsyncClient(timeout=60) as client:
        shorts = [asyncio.ensure_future(stream(client, SHORT)) for _ in range(10)]
        longs = [asyncio.ensure_future(stream(client, LONG)) for _ in range(10)]
        await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 20)
        process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        ready = (await client.get(url + "/readyz")).status_code
        new = (await client.post(url + "/generate", json={"text": "hi"})).status_code
        t0 = time.monotonic()
        short_bodies = await asyncio.gather(*shorts)
        long_bodies = await asyncio.gather(*longs)
        assert time.monotonic() - t0 < GRACE_S + 5
    return list(short_bodies), list(long_bodies), (ready, new)
