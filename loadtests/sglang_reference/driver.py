"""Runs inside an SGLang venv (see `build.py`), never in kvgate's: SGLang's own HTTP request path, in process, up
to the hand-off to the scheduler. Reads one JSON object a line on stdin, `{"id", "route", "body"}`, and writes one a
line on stdout, `{"id", "status": 200, "ids": [...]}` (the prompt token ids the scheduler would be handed) or
`{"id", "status": 4xx/5xx, "error": "..."}` (SGLang's own answer to a request it refuses).

What runs is SGLang's, unchanged:
- the FastAPI app of `sglang.srt.entrypoints.http_server` (`app`), requests sent to it in process through
  httpx's ASGI transport: FastAPI parses the body into SGLang's request models (`protocol.ChatCompletionRequest`,
  `CompletionRequest`, `io_struct.GenerateReqInput`) and its `validation_exception_handler` turns a model error
  into SGLang's 400; the route functions (`openai_v1_chat_completions`, `openai_v1_completions`,
  `generate_request`) run as they are;
- `serving_chat.OpenAIServingChat.handle_request` → `_validate_request`, `_convert_to_internal_request`,
  `_process_messages`, the template call and its encoding; `serving_completions.OpenAIServingCompletion`;
- a real `tokenizer_manager.TokenizerManager` built from `ServerArgs` as `http_server.launch_server` builds it
  (its ZMQ sockets bound, nothing listening), and a real `TemplateManager.initialize_templates`, as
  `_launch_subprocesses` calls it; the handlers are attached to `app.state` as `http_server.lifespan` attaches them.

What is replaced: `TokenizerManager.generate_request`, by `_hand_off` below: it runs the same normalisation
(`GenerateReqInput.normalize_batch_and_arguments`) and the real `TokenizerManager._tokenize_one_request` (tokenize,
`_validate_one_request`, `_create_tokenized_object`), then stops where the real one calls `_send_one_request` (ZMQ to
the scheduler), reporting `input_ids`. What it skips is bookkeeping that does not touch the ids: request state,
the pause condition, the LoRA lock, request logging. Streaming is not driven (the prompt does not depend on it).

The model directory holds only configs: tokenizer.json, tokenizer_config.json, chat_template.jinja and a
config.json of a tiny Llama (`build.py: model_dir`). No weights exist or are read. The architecture is Llama,
not GLM-5's `GlmMoeDsaForCausalLM`: `ServerArgs`' DSA hooks query the CUDA device and cannot run on a CPU build.
The architecture reaches the request path only through the Python chat encoders and the GLM-5.3 port
(`parser/python_chat_template.py: resolve_python_chat_template`, 0.5.23), which is why `_check_architecture`
asserts at start-up that the GLM-5 architecture with this template would render through Jinja too.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CONTEXT_LENGTH = int(os.environ.get("KVGATE_SGLANG_CONTEXT", "65536"))


class Handoff(BaseException):
    """Raised where the real `generate_request` would hand the tokenized request to the scheduler; a
    BaseException, so that no `except Exception` on SGLang's path turns it into an error answer."""

    def __init__(self, ids: list[int]) -> None:
        super().__init__()
        self.ids = ids


def _version() -> str:
    from importlib.metadata import version

    return version("sglang")


def _at_least(v: str, minimum: tuple[int, ...]) -> bool:
    return tuple(int(p) for p in v.split(".")[:3]) >= minimum


def build_app(model_dir: str) -> Any:
    """SGLang's app with its tokenizer manager, template manager and OpenAI handlers, as its launcher sets them."""
    from sglang.srt.entrypoints import http_server
    from sglang.srt.server_args import PortArgs, ServerArgs

    version = _version()
    server_args = ServerArgs(model_path=model_dir, device="cpu", context_length=CONTEXT_LENGTH)
    if _at_least(version, (0, 5, 22)):
        from sglang.srt.runtime_context import publish

        publish(server_args, role="tokenizer")
        from sglang.srt.parser.template_manager import TemplateManager
        from sglang.srt.runtime_context import get_model, get_serving

        chat_template, completion_template = get_serving().chat_template, get_serving().completion_template
        model_path = get_model().model_path
    else:
        from sglang.srt.server_args import set_global_server_args_for_tokenizer

        set_global_server_args_for_tokenizer(server_args)
        from sglang.srt.managers.template_manager import TemplateManager

        chat_template, completion_template = server_args.chat_template, server_args.completion_template
        model_path = server_args.model_path
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    tokenizer_manager = TokenizerManager(server_args, PortArgs.init_new(server_args))
    template_manager = TemplateManager()
    template_manager.initialize_templates(tokenizer_manager=tokenizer_manager, model_path=model_path,
                                          chat_template=chat_template, completion_template=completion_template)
    # as http_server.launch_server sets it from the scheduler's info (min(context − 1, pool − 1) − 5 there)
    tokenizer_manager.max_req_input_len = CONTEXT_LENGTH - 6

    async def _hand_off(obj: Any, request: Any = None) -> Any:
        """`TokenizerManager.generate_request` up to `_send_one_request`."""
        obj.normalize_batch_and_arguments()
        if not obj.is_single:  # a batch of one (a one-element prompt list): its only request, as
            if obj.batch_size != 1:  # _handle_batch_request tokenizes each
                raise ValueError("parity driver: batches of several requests are not driven")
            obj = obj[0]
        for step in ("_set_default_priority",):  # as generate_request, where the version has it
            if hasattr(tokenizer_manager, step):
                getattr(tokenizer_manager, step)(obj)
        if hasattr(tokenizer_manager, "_init_req_state"):  # 0.5.22+: the state _create_tokenized_object reads
            tokenizer_manager._init_req_state(obj, request)
        try:
            tokenized = await tokenizer_manager._tokenize_one_request(obj)
        finally:
            tokenizer_manager.rid_to_state.pop(obj.rid, None)
        raise Handoff([int(i) for i in tokenized.input_ids])
        yield  # an async generator, as the real one

    tokenizer_manager.generate_request = _hand_off  # type: ignore[method-assign]
    state_fields = {"tokenizer_manager": tokenizer_manager, "template_manager": template_manager}
    if "scheduler_info" in getattr(http_server._GlobalState, "__dataclass_fields__", {}):
        state_fields["scheduler_info"] = {"max_req_input_len": CONTEXT_LENGTH - 6}
    http_server.set_global_state(http_server._GlobalState(**state_fields))
    app = http_server.app
    # http_server.lifespan: the OpenAI handlers
    from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion

    app.state.openai_serving_completion = OpenAIServingCompletion(tokenizer_manager, template_manager)
    chat_class = getattr(tokenizer_manager, "serving_chat_class", None)
    if chat_class is None:
        from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat as chat_class
    app.state.openai_serving_chat = chat_class(tokenizer_manager, template_manager)
    _check_architecture(version, tokenizer_manager)
    return app


def _check_architecture(version: str, tokenizer_manager: Any) -> None:
    """The driver's model is a Llama; GLM-5's architecture must not select another renderer for this template."""
    if not _at_least(version, (0, 5, 23)):
        return
    from types import SimpleNamespace

    from sglang.srt.parser import python_chat_template

    template = tokenizer_manager.tokenizer.chat_template
    # resolve_python_chat_template(hf_config, hf_chat_template): only the config's architectures are read
    found = python_chat_template.resolve_python_chat_template(
        SimpleNamespace(architectures=["GlmMoeDsaForCausalLM"]), template)
    if found is not None:
        raise SystemExit("parity driver: GLM-5's architecture would render this template through a Python port")


async def _serve(app: Any) -> None:
    import httpx

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=True)
    async with httpx.AsyncClient(transport=transport, base_url="http://sglang") as client:
        for line in sys.stdin:
            if not line.strip():
                continue
            case = json.loads(line)
            out: dict[str, Any] = {"id": case["id"]}
            try:
                response = await client.post(case["route"], content=json.dumps(case["body"]),
                                             headers={"content-type": "application/json"})
            except BaseException as exc:
                handoff = _find_handoff(exc)
                if handoff is None:
                    out.update(status=599, error="".join(traceback.format_exception(exc))[-2000:])
                else:
                    out.update(status=200, ids=handoff.ids)
            else:
                # a route that answered: SGLang refused it (the hand-off would have raised otherwise)
                out.update(status=response.status_code, error=response.text[:2000])
            sys.stdout.write(json.dumps(out) + "\n")
            sys.stdout.flush()


def _find_handoff(exc: BaseException) -> Handoff | None:
    """The Handoff itself, or inside the exception groups and causes anyio and Starlette wrap it in."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, Handoff):
            return e
        if isinstance(e, BaseExceptionGroup):
            stack.extend(e.exceptions)
        for nxt in (e.__cause__, e.__context__):
            if nxt is not None:
                stack.append(nxt)
    return None


def main() -> None:
    app = build_app(sys.argv[1])
    sys.stdout.write(json.dumps({"ready": _version()}) + "\n")
    sys.stdout.flush()
    asyncio.run(_serve(app))


if __name__ == "__main__":
    main()
