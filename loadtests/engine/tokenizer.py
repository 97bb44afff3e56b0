"""Prompt token counting the way SGLang's TokenizerManager does it.

`transformers.AutoTokenizer` loaded offline from the model's files: `/generate` text and completion prompts encoded
with special tokens, `input_ids` taken as given, chat requests through `chat_template.ChatTemplate`. Nothing here is
shared with the gateway: its parity test compares against us.
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
import tokenizers

from .chat_prompt import ChatPrompt
from .chat_template import ChatTemplate, detect_content_format
from .dialect import Dialect
from .errors import HTTPError

_CACHE_MAX_ENTRIES = 4096
_CACHE_MAX_CHARS = 32_768  # only small prompts are cached; big ones are rare and costly to keep
_THREAD_MIN_CHARS = 16_384  # above this, encode off the event loop (encode_batch_fast releases the GIL)


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


def _default_template(folder: Path) -> str | None:
    """The template AutoTokenizer would load: chat_template.jinja, else tokenizer_config.json's (the first of
    named templates, as SGLang takes it)."""
    beside = folder / "chat_template.jinja"
    if beside.is_file():
        return beside.read_text()
    config = folder / "tokenizer_config.json"
    template = orjson.loads(config.read_bytes()).get("chat_template") if config.is_file() else None
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict)), None)
    return template if isinstance(template, str) else None


def _explicit_template(path: str) -> tuple[str, str]:
    """sglang template_manager: TemplateManager._load_jinja_template. Returns (text to detect the content format
    on, template to render with): outer newlines stripped, then each literal backslash-n made a newline."""
    text = Path(path).read_text().strip("\n")
    return text, text.replace("\\n", "\n")


# Tokenizers loaded ahead of time by `preload` (in the test harness's fork server), each handed to one engine, by
# the tokenizer file they were loaded from. An engine with a chat template of its own sets it on the one it takes.
_warm_backends: dict[str, tokenizers.Tokenizer] = {}
_warm_hf: dict[str, Any] = {}


def preload(tokenizer: str) -> None:
    """Load `tokenizer` (and transformers, ~2.5 s of CPU together) now, so that an engine forked from this process
    starts without parsing anything. Each loaded object is taken by the first engine that asks for it."""
    path = str(prepare_tokenizer_dir(tokenizer, None))
    _warm_backends[tokenizer] = tokenizers.Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    _warm_hf[tokenizer] = _load_hf(path)


def _load_hf(path: str) -> Any:
    from transformers import AutoTokenizer  # slow import: only engines that serve chats pay it

    return AutoTokenizer.from_pretrained(path)


class PromptTokenizer:
    """Text prompts are encoded with the raw `tokenizers` backend (the same ids as AutoTokenizer's for every
    tokenizer shipped here); transformers, slow to import, is loaded only once a chat request needs its template."""

    def __init__(self, tokenizer: str, chat_template: str | None, dialect: Dialect) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        self.path = str(prepare_tokenizer_dir(tokenizer, chat_template))
        self._source = tokenizer
        self.backend = _warm_backends.pop(tokenizer, None) or tokenizers.Tokenizer.from_file(
            str(Path(self.path) / "tokenizer.json"))
        self.backend.no_truncation()
        self.backend.no_padding()
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        self._cache: OrderedDict[Any, list[int]] = OrderedDict()
        self._dialect = dialect
        self._explicit = _explicit_template(chat_template) if chat_template is not None else None
        detect_on = self._explicit[0] if self._explicit is not None else _default_template(Path(self.path))
        self.content_format = detect_content_format(detect_on) if isinstance(detect_on, str) else "string"
        self._chat: ChatTemplate | None = None

    @property
    def chat(self) -> ChatTemplate:
        """The chat-template calls, with transformers' tokenizer loaded on first use."""
        if self._chat is None:
            hf = _warm_hf.pop(self._source, None) or _load_hf(self.path)
            if self._explicit is not None:
                hf.chat_template = self._explicit[1]
            elif isinstance(hf.chat_template, dict):  # named templates: SGLang takes the first
                hf.chat_template = next(iter(hf.chat_template.values()))
            self._chat = ChatTemplate(hf, self.path, self._dialect)
        return self._chat

    def close(self) -> None:
        if self._chat is not None:
            self._chat.close()

    # counting
    async def encode_text(self, text: str) -> list[int]:
        """`tokenizer(text).input_ids`, as SGLang does for /generate text and completion prompts."""
        return await self._encode(("t", text), text, True)

    async def encode_chat(self, prompt: ChatPrompt) -> list[int]:
        """The ids SGLang's chat handler hands the engine (cached by what reaches the template)."""
        if prompt.input_ids is not None:
            return prompt.input_ids
        key = ("c", prompt.cache_key)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        chat = self._chat or await asyncio.get_running_loop().run_in_executor(None, lambda: self.chat)
        ids = await chat.ids(prompt)
        if len(key[1]) <= _CACHE_MAX_CHARS:
            self._remember(key, ids)
        return ids

    async def _encode(self, key: Any, text: str, special: bool) -> list[int]:
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        try:
            if len(text) >= _THREAD_MIN_CHARS:
                loop = asyncio.get_running_loop()
                enc = await loop.run_in_executor(
                    None, lambda: self.backend.encode_batch_fast([text], add_special_tokens=special))
                ids = enc[0].ids
            else:
                ids = self.backend.encode(text, add_special_tokens=special).ids
        except TypeError as e:  # lone surrogates
            raise HTTPError(400, f"Invalid prompt text: {e}") from e
        if len(text) <= _CACHE_MAX_CHARS:
            self._remember(key, ids)
        return ids

    def _remember(self, key: Any, ids: list[int]) -> None:
        self._cache[key] = ids
        if len(self._cache) > _CACHE_MAX_ENTRIES:
            self._cache.popitem(last=False)

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
