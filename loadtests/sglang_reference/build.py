"""One virtual environment per SGLang version, built once and cached: `~/.cache/kvgate/sglang-<V>/`
(`KVGATE_SGLANG_CACHE` moves the root). Also the configs-only model directory the driver serves.

What goes in: `sglang==V` without its dependencies (most of them are CUDA kernels), torch 2.13.0 (the CPU build this
machine keeps on disk; a plain `torch` would fetch a CUDA build), the transformers version that SGLang version pins,
and the pure-Python packages (plus triton and apache-tvm-ffi, which import on a CPU) that the request path's imports
need, at SGLang's own pins where it pins them. `stubs/` stands in for the CUDA-only wheels (`sgl_kernel`,
`torchvision`): see `stubs/README.md`. A venv is reused while its stamp (the version, this file's package lists and
the stubs) is unchanged.

    python -m loadtests.sglang_reference.build [VERSION ...]   # build (or check) the venvs
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STUBS = HERE / "stubs"
GLM5 = ROOT / "config/models/glm-5"
VERSIONS = ("0.5.8", "0.5.22", "0.5.23")
TORCH = "torch==2.13.0"
# What each version pins (its wheel's Requires-Dist): the pins below are read from the wheel, not repeated here.
TRANSFORMERS = {"0.5.8": "transformers==4.57.1", "0.5.22": "transformers==5.19.0", "0.5.23": "transformers==5.19.0"}
# The import path of http_server, serving_chat and tokenizer_manager; each taken at SGLang's pin if it has one.
COMMON = [
    "tokenizers", "huggingface_hub", "safetensors", "regex", "numpy", "pyyaml", "tqdm", "packaging", "filelock",
    "sympy", "networkx", "jinja2", "fsspec", "typing_extensions", "fastapi", "pydantic", "orjson", "uvicorn",
    "pyzmq", "aiohttp", "requests", "psutil", "pybase64", "partial_json_parser", "msgspec", "openai",
    "setproctitle", "xxhash", "zstandard", "interegular", "pillow", "jsonschema", "python-multipart", "httpx",
    "triton", "IPython", "uvloop", "watchfiles", "dill", "apache-tvm-ffi", "sentencepiece", "compressed-tensors",
    "gguf", "xgrammar", "einops", "soundfile", "setuptools>=77", "blobfile", "outlines", "llguidance",
    "python-dateutil", "scipy", "modelscope", "tiktoken", "anthropic", "openai-harmony", "pydantic-settings",
    "prometheus-client", "distro", "cloudpickle", "nest_asyncio", "hf_transfer", "loguru",
]
# Names installed without their dependencies (they would pull a CUDA torch or other heavy wheels in).
NO_DEPS = {"compressed-tensors", "xgrammar", "outlines", "llguidance", "modelscope", "openai-harmony", "triton"}
EXTRA = {  # per version, what its own import path adds
    "0.5.8": [],
    "0.5.22": [],
    "0.5.23": [],
}


def cache_root() -> Path:
    return Path(os.environ.get("KVGATE_SGLANG_CACHE", Path.home() / ".cache/kvgate"))


def venv_dir(version: str) -> Path:
    return cache_root() / f"sglang-{version}"


def python_for(version: str) -> Path:
    return venv_dir(version) / "bin/python"


def _stamp(version: str) -> str:
    h = hashlib.sha256()
    h.update(version.encode())
    h.update(json.dumps([TORCH, TRANSFORMERS[version], COMMON, sorted(NO_DEPS), EXTRA[version]]).encode())
    for path in sorted(STUBS.rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()


def is_built(version: str) -> bool:
    stamp = venv_dir(version) / ".kvgate-stamp"
    return stamp.is_file() and stamp.read_text() == _stamp(version)


def model_dir() -> Path:
    """GLM-5's tokenizer and template beside a config.json of a one-layer Llama: configs only, no weights. (The
    architecture is Llama because SGLang's DSA hooks for GLM-5's need a CUDA device; see driver.py.)"""
    out = cache_root() / "models/glm-5"
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 65536,
              "vocab_size": 154880, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 4, "num_hidden_layers": 1, "torch_dtype": "bfloat16"}
    files = {"tokenizer.json": gzip.decompress((GLM5 / "tokenizer.json.gz").read_bytes()),
             "tokenizer_config.json": (GLM5 / "tokenizer_config.json").read_bytes(),
             "chat_template.jinja": (GLM5 / "chat_template.jinja").read_bytes(),
             "config.json": json.dumps(config).encode()}
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        path = out / name
        if not path.is_file() or path.read_bytes() != data:
            path.write_bytes(data)
    return out


def _pins(metadata: str) -> dict[str, str]:
    """SGLang's own `name==version` pins (unconditional ones), by normalised name."""
    pins = {}
    for line in metadata.splitlines():
        m = re.match(r"Requires-Dist: ([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*==\s*([^;\s]+)\s*$", line)
        if m:
            pins[_norm(m.group(1))] = m.group(2)
    return pins


def _installed_metadata(target: Path, version: str) -> str | None:
    found = list(target.glob(f"lib/python*/site-packages/sglang-{version}.dist-info/METADATA"))
    return found[0].read_text() if found else None


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pip(py: Path, *args: str) -> None:
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args], check=True)


def build(version: str, *, log: bool = True) -> Path:
    """The venv's python, built if missing or stale."""
    if is_built(version):
        return python_for(version)
    target = venv_dir(version)
    if log:
        print(f"building the SGLang {version} venv in {target} (once; a few minutes)", file=sys.stderr)
    py = python_for(version)
    if _installed_metadata(target, version) is None:  # else only what the lists added is installed
        shutil.rmtree(target, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(target)], check=True)
        wheels = target / "wheels"
        wheels.mkdir()
        subprocess.run([str(py), "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(wheels),
                        f"sglang=={version}"], check=True)
        _pip(py, TORCH, TRANSFORMERS[version], "--no-deps")
        _pip(py, "--no-deps", str(next(wheels.glob("sglang-*.whl"))))
        shutil.rmtree(wheels)
    metadata = _installed_metadata(target, version)
    assert metadata is not None
    pins = _pins(metadata)
    names = COMMON + EXTRA[version]

    def spec(name: str) -> str:
        bare = re.split(r"[<>=]", name)[0]
        return f"{bare}=={pins[_norm(bare)]}" if _norm(bare) in pins and bare == name else name

    free = [spec(n) for n in names if re.split(r"[<>=]", n)[0] not in NO_DEPS]
    _pip(py, TORCH, TRANSFORMERS[version], *free)  # torch and transformers named again: nothing may move them
    _pip(py, "--no-deps", *[spec(n) for n in names if n in NO_DEPS])
    # prove it: the driver's imports
    subprocess.run([str(py), "-c", "import sglang.srt.entrypoints.http_server, sglang.srt.managers.tokenizer_manager"],
                   check=True, env=driver_env(), stdout=subprocess.DEVNULL)
    (target / ".kvgate-stamp").write_text(_stamp(version))
    return py


def driver_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONPATH=str(STUBS), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    return env


def main(argv: list[str]) -> int:
    for version in argv or VERSIONS:
        print(version, build(version))
    print(model_dir())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
