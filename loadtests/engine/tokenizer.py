"""Prompt token counting the way SGLang's TokenizerManager does it.

`transformers.AutoTokenizer` loaded offline from the model's files; chat rendered with `apply_chat_template`
(add_generation_prompt=True) and encoded without special tokens, `/generate` text and completion prompts encoded
with them, `input_ids` taken as given. Nothing here is shared with the gateway: its parity test compares against us.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import os
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import orjson

_CACHE_MAX_ENTRIES = 4096
_CACHE_MAX_CHARS = 32_768  # only small prompts are cached; big ones are rare and costly to keep
_THREAD_MIN_CHARS = 16_384  # above this, encode off the event loop (encode_batch_fast releases the GIL)


class TokenizeError(ValueError):
    """The prompt cannot be tokenized (e.g. lone surrogates); SGLang answers 400."""


def prepare_tokenizer_dir(tokenizer: str, chat_template: str | None) -> Path:
    """Return a directory `AutoTokenizer.from_pretrained` can load offline.

    Accepts a directory, a tokenizer.json or a tokenizer.json.gz; a gzipped file is decompressed once into a cache
    directory keyed by its content hash, next to copies of tokenizer_config.json and the chat template.
    """
    src = Path(tokenizer)
    if src.is_dir():
        if chat_template is None:
            return src
        src = src / "tokenizer.json"
    src_dir = src.parent
    template = Path(chat_template) if chat_template else src_dir / "chat_template.jinja"
    digest = hashlib.sha256(src.read_bytes()).hexdigest()[:16]
    tdigest = hashlib.sha256(template.read_bytes()).hexdigest()[:8] if template.exists() else "none"
    root = Path(os.environ.get("KVGATE_ENGINE_CACHE", Path(tempfile.gettempdir()) / "kvgate-engine-tokenizers"))
    out = root / f"{digest}-{tdigest}"
    if (out / "tokenizer.json").exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix="tmp-"))
    data = gzip.decompress(src.read_bytes()) if src.suffix == ".gz" else src.read_bytes()
    (tmp / "tokenizer.json").write_bytes(data)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (src_dir / name).exists():
            shutil.copy(src_dir / name, tmp / name)
    if template.exists():
        shutil.copy(template, tmp / "chat_template.jinja")
    try:
        tmp.rename(out)  # atomic publish; a concurrent engine may have won the race
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


class PromptTokenizer:
    def __init__(self, tokenizer: str, chat_template: str | None) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoTokenizer  # slow import, done once per process

        self.path = str(prepare_tokenizer_dir(tokenizer, chat_template))
        self.hf = AutoTokenizer.from_pretrained(self.path)
        self.backend = self.hf.backend_tokenizer
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        self._cache: OrderedDict[Any, list[int]] = OrderedDict()

    # counting
    async def encode_text(self, text: str) -> list[int]:
        """`tokenizer(text).input_ids`, as SGLang does for /generate text and completion prompts."""
        return await self._encode(("t", text), text, True)

    async def encode_chat(self, messages: list[Any], tools: list[Any] | None,
                          template_kwargs: dict[str, Any] | None) -> list[int]:
        """`apply_chat_template(..., tokenize=True, add_generation_prompt=True)` split into render + encode."""
        key = ("c", orjson.dumps([messages, tools, template_kwargs]))
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        try:
            rendered = self.hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                                   **(template_kwargs or {}))
        except Exception as e:  # jinja errors surface as 400 in SGLang
            raise TokenizeError(f"Failed to apply chat template: {e}") from e
        return await self._encode(key, rendered, False)

    async def _encode(self, key: Any, text: str, special: bool) -> list[int]:
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        try:
            if len(text) >= _THREAD_MIN_CHARS:
                loop = asyncio.get_running_loop()
                enc = await loop.run_in_executor(None, self.backend.encode_batch_fast, [text], special)
                ids = enc[0].ids
            else:
                ids = self.backend.encode(text, add_special_tokens=special).ids
        except TypeError as e:  # lone surrogates
            raise TokenizeError(f"Invalid prompt text: {e}") from e
        if len(text) <= _CACHE_MAX_CHARS:
            self._cache[key] = ids
            if len(self._cache) > _CACHE_MAX_ENTRIES:
                self._cache.popitem(last=False)
        return ids

    # detokenizing
    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)


class StreamDetokenizer:
    """Incremental text for streamed tokens: per-token pieces from a shared cache, falling back to a full decode
    while a piece is an incomplete UTF-8 sequence (as SGLang's detokenizer holds back a trailing U+FFFD)."""

    def __init__(self, tok: PromptTokenizer, pieces: dict[int, str]) -> None:
        self._tok = tok
        self._pieces = pieces
        self._ids: list[int] = []
        self._exact = True
        self.text = ""

    def push(self, token: int) -> str:
        """Append a token; return the new text delta (possibly empty)."""
        self._ids.append(token)
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._tok.decode([token])
        if self._exact and "\ufffd" not in piece:
            self.text += piece
            return piece
        self._exact = False
        full = self._tok.decode(self._ids)
        if full.endswith("\ufffd"):
            return ""
        delta, self.text = full[len(self.text):], full
        return delta
