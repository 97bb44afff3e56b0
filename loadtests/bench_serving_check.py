"""SGLang's own load generator through kvgate: `python -m loadtests.bench_serving_check --python PY`.

Runs `python -m sglang.bench_serving` on its three SGLang backends (`sglang`: /generate, `sglang-oai`:
/v1/completions, `sglang-oai-chat`: /v1/chat/completions), streaming, against kvgate in front of an emulated PD
pair, with a local ShareGPT-format file (no hub download) and the GLM-5 tokenizer from config/. `PY` is a Python with
sglang installed (its bench_serving imports datasets, transformers, IPython…: too heavy for the test suite's
environment, so this runs as a benchmark), e.g.:

    python3 -m venv /tmp/bs && /tmp/bs/bin/pip install --no-deps sglang==0.5.8 && \\
        /tmp/bs/bin/pip install aiohttp numpy pybase64 requests "datasets<4" pillow tqdm ipython transformers==4.57.1

Final lines (machine-readable): `backend=… completed=N/N failed=…`, then `bench_serving_ok=1` when every request
of every backend succeeded.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from loadtests.engine.harness import free_port, start_pair
from loadtests.procstat import wait_ready

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "config/models/glm-5"
BACKENDS = ("sglang", "sglang-oai", "sglang-oai-chat")
_WORDS = ("gateway tenant prefill decode cache token limit stream request answer engine pool budget replica "
          "latency throughput context prompt model").split()


def _sharegpt(path: Path, conversations: int) -> None:
    rng = random.Random(7)

    def text(words: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(words)) + "."

    data = [{"id": f"c{i}", "conversations": [{"from": "human", "value": text(rng.randint(20, 300))},
                                              {"from": "gpt", "value": text(rng.randint(10, 150))}]}
            for i in range(conversations)]
    path.write_text(json.dumps(data))


def _tokenizer_dir(directory: Path) -> Path:
    target = directory / "glm-5-tokenizer"
    target.mkdir()
    with gzip.open(MODEL_DIR / "tokenizer.json.gz", "rb") as source, open(target / "tokenizer.json", "wb") as out:
        shutil.copyfileobj(source, out)
    shutil.copy(MODEL_DIR / "tokenizer_config.json", target / "tokenizer_config.json")
    return target


def _gateway_config(directory: Path, prefill: object, decode: object) -> tuple[Path, int]:
    port = free_port()
    document = {"listen": {"host": "127.0.0.1", "port": port}, "logging": {"access_log": False},
                "models": [{"name": "glm-5", "tokenizer": str(MODEL_DIR / "tokenizer.json.gz"),
                            "chat_template": str(MODEL_DIR / "chat_template.jinja"), "context_length": 8192,
                            "min_engine_version": "0.5.8",
                            "prefill": [{"url": prefill.url, "bootstrap_port": prefill.bootstrap_port}],  # type: ignore[attr-defined]
                            "decode": [{"url": decode.url}]}]}  # type: ignore[attr-defined]
    path = directory / "kvgate.yaml"
    path.write_text(yaml.safe_dump(document))
    return path, port


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--python", default=sys.executable, help="a Python with sglang installed")
    parser.add_argument("--num-prompts", type=int, default=200)
    args = parser.parse_args(argv)
    results: dict[str, tuple[int, int]] = {}
    with tempfile.TemporaryDirectory() as temp, \
            start_pair(prefill_pool=500_000, decode_pool=500_000, context_length=8192, model="glm-5",
                       version="0.5.8", bug=False) as pair:
        directory = Path(temp)
        dataset = directory / "sharegpt.json"
        _sharegpt(dataset, args.num_prompts * 2)
        tokenizer = _tokenizer_dir(directory)
        config, port = _gateway_config(directory, pair.prefill, pair.decode)
        url = f"http://127.0.0.1:{port}"
        gateway = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
                                    "--log-level", "warning"], cwd=ROOT)
        try:
            wait_ready(url, gateway, timeout_s=90)
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
            for backend in BACKENDS:
                run = subprocess.run(
                    [args.python, "-m", "sglang.bench_serving", "--backend", backend, "--base-url", url,
                     "--dataset-name", "sharegpt", "--dataset-path", str(dataset), "--num-prompts",
                     str(args.num_prompts), "--tokenizer", str(tokenizer), "--model", "glm-5",
                     "--max-concurrency", "32", "--seed", "1"],
                    capture_output=True, text=True, env=env, cwd=directory, timeout=600)
                completed = re.search(r"Successful requests:\s+(\d+)", run.stdout)
                done = int(completed[1]) if completed else 0
                results[backend] = (done, args.num_prompts)
                if run.returncode != 0 or completed is None:
                    print(run.stdout[-3000:], run.stderr[-3000:], sep="\n", file=sys.stderr)
                print(f"backend={backend} completed={done}/{args.num_prompts} failed={args.num_prompts - done}",
                      flush=True)
        finally:
            gateway.terminate()
            gateway.wait(timeout=60)
    ok = all(done == total for done, total in results.values()) and len(results) == len(BACKENDS)
    print(f"bench_serving_ok={int(ok)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
