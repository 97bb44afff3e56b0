"""The chat-template call exactly as SGLang makes it, per dialect, with its retry and error mapping.

0.5.8 (`serving_chat.py: OpenAIServingChat._apply_jinja_template`) calls `apply_chat_template(tokenize=True, ...)`, so
`chat_template_kwargs` such as `padding`/`max_length`/`truncation`/`tokenizer_kwargs`/`chat_template` reach the
tokenizer and change the ids. 0.5.22+ (`_render_and_encode_chat_template`) renders to text and encodes it. The calls
run on one worker thread. A tokenizing call given such knobs leaves padding/truncation state on its tokenizer, so it
runs on a second tokenizer, loaded on first need (about half a second); all other calls leave the shared one as is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jinja2

from .chat_prompt import ChatPrompt
from .dialect import Dialect
from .errors import HTTPError


def _accesses_content(node: jinja2.nodes.Node, names: tuple[str, ...]) -> bool:
    """`names[i].content` / `names[i]['content']`, possibly filtered, tested or sliced."""
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _accesses_content(node.node, names)
    if isinstance(node, jinja2.nodes.Test):
        return _accesses_content(node.node, names)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _accesses_content(node.node, names)
    if isinstance(node, jinja2.nodes.Getitem):
        target, key = node.node, node.arg.value if isinstance(node.arg, jinja2.nodes.Const) else None
    elif isinstance(node, jinja2.nodes.Getattr):
        target, key = node.node, node.attr
    else:
        return False
    return key == "content" and isinstance(target, jinja2.nodes.Name) and target.ctx == "load" \
        and target.name in names


def detect_content_format(template: str) -> str:
    """sglang jinja_template_utils.py: detect_jinja_template_content_format. "openai" (content parts kept as a list)
    when the template mentions media or loops over message/msg/m `.content`, else "string"."""
    if any(word in template for word in ("image", "audio", "video", "vision")):
        return "openai"
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        ast = _compile_jinja_template(template).environment.parse(template)
        loops = list(ast.find_all(jinja2.nodes.For))
    except Exception:  # an unparsable template is "string", as in SGLang
        return "string"
    return "openai" if any(_accesses_content(loop.iter, ("message", "msg", "m")) for loop in loops) else "string"


def _batch_of_one(ids: Any) -> list[int]:
    """`return_tensors` in 0.5.8's chat_template_kwargs yields an array of shape (1, n): SGLang takes it as a
    batch of one prompt."""
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    return ids[0] if ids and isinstance(ids[0], list) else ids


# apply_chat_template parameters that configure the tokenizer when it tokenizes
_TOKENIZER_KNOBS = frozenset({"padding", "truncation", "max_length", "tokenizer_kwargs"})


class ChatTemplate:
    """The chat-template calls of one engine, on one worker thread; `ids` is awaited from the event loop."""

    def __init__(self, hf: Any, path: str, dialect: Dialect) -> None:
        self.dialect = dialect
        self.hf = hf  # shared with the event loop's text encodes: only state-free calls go here
        self._path = path
        self._knob_hf: Any = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="chat-template")
        # 0.5.22+: encode the rendered text without specials only if the tokenizer would add some
        self._encode_kwargs = {"add_special_tokens": False} if hf.encode("") else {}
        self._lossy = dialect >= Dialect.V0_5_22 and self._round_trip_is_lossy()

    def _round_trip_is_lossy(self) -> bool:
        """sglang 0.5.22 serving_chat.py: OpenAIServingChat._probe_prompt_text_round_trip."""
        probe = [{"role": "user", "content": "x"}]
        try:
            text = self.hf.apply_chat_template(probe, tokenize=False, add_generation_prompt=True, return_dict=False)
            via_ids = self.hf.apply_chat_template(probe, tokenize=True, add_generation_prompt=True, return_dict=False)
            return list(self.hf.encode(text, **self._encode_kwargs)) != list(via_ids)
        except Exception:
            return False

    def _tokenizer_for(self, p: ChatPrompt) -> Any:
        tokenizes = self.dialect < Dialect.V0_5_22 or self._lossy
        if not (tokenizes and _TOKENIZER_KNOBS & p.template_kwargs.keys()):
            return self.hf
        if self._knob_hf is None:
            from transformers import AutoTokenizer

            self._knob_hf = AutoTokenizer.from_pretrained(self._path)
            self._knob_hf.chat_template = self.hf.chat_template
        return self._knob_hf

    async def ids(self, prompt: ChatPrompt) -> list[int]:
        """The prompt ids SGLang's chat handler produces; raises HTTPError with SGLang's status and error type."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._ids, prompt)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _ids(self, p: ChatPrompt) -> list[int]:
        hf = self._tokenizer_for(p)
        try:
            ids = self._render_0_5_8(hf, p) if self.dialect < Dialect.V0_5_22 else self._render(hf, p)
            if p.assistant_prefix:  # _append_assistant_prefix_to_prompt_ids
                prefix = hf.encode(p.assistant_prefix)
                if prefix and prefix[0] == hf.bos_token_id:
                    prefix = prefix[1:]
                ids = ids + prefix
            return ids
        except ValueError as e:  # OpenAIServingBase.handle_request
            raise HTTPError(400, str(e), "BadRequest") from e
        except Exception as e:
            raise HTTPError(500, f"Internal server error: {e}", "InternalServerError") from e

    def _render_0_5_8(self, hf: Any, p: ChatPrompt) -> list[int]:
        def call(tools: list[Any] | None) -> Any:
            return hf.apply_chat_template(p.messages, tokenize=True, add_generation_prompt=True, tools=tools,
                                          reasoning_effort=p.reasoning_effort, **p.template_kwargs, return_dict=False)

        # the retry wraps each tool as {"function": tool}; only a jinja error on it becomes a 400 by itself
        ids = _with_retry(call, p.tools, lambda t: t if "function" in t else {"function": t}, (jinja2.TemplateError,))
        return _batch_of_one(ids)

    def _render(self, hf: Any, p: ChatPrompt) -> list[int]:
        kwargs = {} if p.reasoning_effort is None else {"reasoning_effort": p.reasoning_effort}
        kwargs.update(p.template_kwargs)

        def call(tools: list[Any] | None) -> Any:
            if self._lossy:
                return hf.apply_chat_template(p.messages, tokenize=True, add_generation_prompt=True, tools=tools,
                                              return_dict=False, **kwargs)
            text = hf.apply_chat_template(p.messages, tokenize=False, add_generation_prompt=True, tools=tools,
                                          return_dict=False, **kwargs)
            return hf.encode(text, **self._encode_kwargs)

        # the retry flattens each tool to its function; jinja errors and TypeErrors on it are 400s
        ids = _with_retry(call, p.tools, lambda t: t["function"] if "function" in t else t,
                          (jinja2.TemplateError, TypeError))
        return list(ids)


def _with_retry(call: Callable[[list[Any] | None], Any], tools: list[Any] | None,
                reshape: Callable[[Any], Any], client_errors: tuple[type[BaseException], ...]) -> Any:
    """Any failure is retried once with the tools reshaped; a client error on the retry becomes a ValueError."""
    try:
        return call(tools)
    except Exception:
        try:
            return call([reshape(t) for t in tools] if tools else None)
        except client_errors as e:
            raise ValueError(str(e)) from e
