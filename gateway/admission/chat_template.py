"""Render chat messages to the prompt text the engine will tokenize.

Follows Hugging Face `apply_chat_template` semantics (what SGLang calls): a sandboxed jinja2 environment with
`trim_blocks`/`lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter that keeps non-ASCII text, the
`raise_exception` and `strftime_now` globals, and the tokenizer's special tokens as variables.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(Exception):
    """No usable chat template could be found or compiled."""


class RenderFailed(Exception):
    """The template raised while rendering the client's chat (SGLang answers such a request with 400 or 500)."""


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template plus the special-token variables it may reference."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            ast = env.parse(source)
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
        self.special_tokens = dict(special_tokens or {})
        self.variables_read = frozenset(jinja2.meta.find_undeclared_variables(ast))
        self.content_format = _content_format(source, ast)

    @classmethod
    def for_tokenizer(cls, tokenizer_path: Path, template_path: Path | None = None) -> ChatTemplate:
        """The explicit template file if given, else `chat_template` in tokenizer_config.json beside the tokenizer,
        else `chat_template.jinja` beside it."""
        folder = tokenizer_path.parent
        config = _read_tokenizer_config(folder / "tokenizer_config.json")
        special_tokens = {key: _token_text(config[key]) for key in _SPECIAL_TOKEN_KEYS if config.get(key)}
        if template_path is not None:
            return cls(template_path.read_text(encoding="utf-8"), special_tokens)
        embedded = config.get("chat_template")
        if isinstance(embedded, str):
            return cls(embedded, special_tokens)
        beside = folder / "chat_template.jinja"
        if beside.is_file():
            return cls(beside.read_text(encoding="utf-8"), special_tokens)
        raise ChatTemplateError(f"no chat template for {tokenizer_path}: set chat_template in the model's config")

    def render(self, messages: list[dict[str, Any]], *, tools: list[Any] | None = None,
               documents: list[Any] | None = None, add_generation_prompt: bool = True,
               extra: dict[str, Any] | None = None) -> str:
        """The prompt text, as transformers' `render_jinja_template` produces it. Raises RenderFailed."""
        variables = {**self.special_tokens, **(extra or {})}
        try:
            return self._template.render(messages=messages, tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except (jinja2.exceptions.TemplateError, TypeError, AttributeError, ValueError, KeyError, IndexError,
                RecursionError) as exc:
            raise RenderFailed(f"{type(exc).__name__}: {exc}") from exc


def _read_tokenizer_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    loaded = json.loads(path.read_text(encoding="utf-8"))
    return loaded if isinstance(loaded, dict) else {}


def _token_text(value: Any) -> str:
    return value.get("content", "") if isinstance(value, dict) else str(value)


# Template text that makes SGLang hand content parts to the template as a list ("openai" format).
_OPENAI_FORMAT_WORDS = ("image", "audio", "video", "vision")
_CONTENT_OWNERS = ("message", "msg", "m")


def _content_format(source: str, ast: jinja2.nodes.Template) -> str:
    """"openai" when the template iterates over message content, else "string"
    (sglang parser/jinja_template_utils.py: detect_jinja_template_content_format)."""
    if any(word in source for word in _OPENAI_FORMAT_WORDS):
        return "openai"
    for loop in ast.find_all(jinja2.nodes.For):
        if any(_reads_content(loop.iter, owner) for owner in _CONTENT_OWNERS):
            return "openai"
    return "string"


def _reads_content(node: jinja2.nodes.Node, owner: str) -> bool:
    """`owner.content` or `owner['content']`, possibly under filters, tests or a slice."""
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _reads_content(node.node, owner)
    if isinstance(node, jinja2.nodes.Test):
        return _reads_content(node.node, owner)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reads_content(node.node, owner)
    if isinstance(node, jinja2.nodes.Getitem):
        return _is_name(node.node, owner) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_name(node.node, owner) and node.attr == "content"
    return False


def _is_name(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name
