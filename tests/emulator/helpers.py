"""Engines per SGLang dialect and an independent re-enactment of what SGLang hands its chat template.

`post` adds `bootstrap_host: 2.2.2.2` (SGLang's FAKE transfer backend), so a lone prefill or decode answers;
`post_pd` drives a real pair, whose decode then echoes the prompt it was handed. The re-enactment uses transformers
directly; it imports nothing from the emulator.
"""

from __future__ import annotations

import gzip
import itertools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from loadtests.engine.harness import RunningEngine, free_port

REPO = Path(__file__).resolve().parents[2]
GLM5 = REPO / "config" / "models" / "glm-5"
VERSIONS = ("0.5.8", "0.5.22", "0.5.23")
FAKE = {"bootstrap_host": "2.2.2.2", "bootstrap_room": 0}
CONTEXT = 65536
_rooms = itertools.count(1)


def start_engines(specs: list[tuple[str, dict[str, Any]]]) -> list[RunningEngine]:
    """Launch every (role, options) engine at once, then wait for all: startup is mostly tokenizer loading.
    A prefill directly followed by a decode forms a pair (the decode's default bootstrap port is the prefill's)."""
    engines: list[RunningEngine] = []
    for role, opts in specs:
        paired = role == "decode" and engines and engines[-1].role == "prefill"
        engines.append(RunningEngine(
            role, "127.0.0.1", free_port(), engines[-1].bootstrap_port if paired else free_port(),
            {"model": "glm-5-emu", "tokenizer": str(GLM5 / "tokenizer.json.gz"), "pool_tokens": CONTEXT,
             "context_length": CONTEXT, "health_delay_s": 0, **opts}))
    try:
        for eng in engines:
            eng.launch()
        for eng in engines:
            eng.wait_ready()
    except BaseException:
        stop_all(engines)
        raise
    return engines


def stop_all(engines: list[RunningEngine]) -> None:
    for eng in engines:
        eng.stop()


def post(engine: RunningEngine, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    r = httpx.post(engine.url + path, json={**body, **FAKE}, timeout=30)
    return r.status_code, r.json()


def post_pd(prefill: RunningEngine, decode: RunningEngine, path: str, body: dict[str, Any]) -> Any:
    """Both halves at once with the same room, as a PD router sends them; returns the decode's answer."""
    full = {**body, "bootstrap_host": prefill.host, "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": next(_rooms)}
    with ThreadPoolExecutor(2) as pool:
        halves = [pool.submit(httpx.post, eng.url + path, json=full, timeout=30) for eng in (prefill, decode)]
        p, d = (h.result() for h in halves)
    assert p.status_code == d.status_code == 200, (p.text, d.text)
    return d.json()


def post_stream(engine: RunningEngine, path: str, body: dict[str, Any]) -> tuple[int, list[bytes]]:
    """The raw `data:` payloads of a stream, `[DONE]` excluded (checked)."""
    r = httpx.post(engine.url + path, json={**body, **FAKE, "stream": True}, timeout=30)
    events = [e for e in r.content.split(b"\n\n") if e]
    assert all(e.startswith(b"data: ") for e in events), r.content
    assert events[-1] == b"data: [DONE]", r.content
    return r.status_code, [e[len(b"data: "):] for e in events[:-1]]


class Reenactment:
    """transformers' own apply_chat_template on the messages, tools and kwargs SGLang would pass."""

    def __init__(self, tmp: Path) -> None:
        from transformers import AutoTokenizer

        (tmp / "tokenizer.json").write_bytes(gzip.decompress((GLM5 / "tokenizer.json.gz").read_bytes()))
        for name in ("tokenizer_config.json", "chat_template.jinja"):
            (tmp / name).write_bytes((GLM5 / name).read_bytes())
        self.hf = AutoTokenizer.from_pretrained(str(tmp))

    def ids(self, version: str, messages: list[dict[str, Any]], tools: list[Any] | None = None,
            kwargs: dict[str, Any] | None = None, prefix: str | None = None, template: str | None = None) -> list[int]:
        """0.5.8: one `tokenize=True` call (tokenizer knobs in kwargs apply); 0.5.22+: render, then encode."""
        kw = dict(kwargs or {})
        if template is not None:
            kw.setdefault("chat_template", template)
        if version == "0.5.8":
            ids = self.hf.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True,
                                              return_dict=False, **kw)
        else:
            text = self.hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                               **kw)
            ids = self.hf.encode(text)
        return list(ids) + (self.hf.encode(prefix) if prefix else [])

    def text_ids(self, text: str) -> list[int]:
        return self.hf.encode(text)

    def text(self, ids: list[int]) -> str:
        """What a decode that generates exactly these ids answers (special tokens are skipped)."""
        return self.hf.decode(ids, skip_special_tokens=True)
