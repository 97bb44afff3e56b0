"""kvgate's answer to each case, from its own admission code in process (`gateway.admission.pipeline.admit_body`,
as the HTTP edge calls it), and the emulator's (`loadtests.engine`), for one SGLang version (dialect)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.admission.chat import ChatSettings
from gateway.admission.dialects import Dialect, dialect_for
from gateway.admission.pipeline import admit_body, build_admission
from gateway.config import ModelConfig
from gateway.errors import GatewayError

from . import build
from .cases import MODEL

CONTEXT = 65536


@dataclass(frozen=True, slots=True)
class KvgateAnswer:
    status: int
    count: int | None = None
    engine_body: dict[str, Any] | None = None  # what kvgate forwards (the reduced request it counted)
    error: str | None = None


class _Model:
    def __init__(self, version: str) -> None:
        config = ModelConfig(name=MODEL, tokenizer=build.GLM5 / "tokenizer.json.gz",
                             chat_template=build.GLM5 / "chat_template.jinja", context_length=CONTEXT,
                             prefill=[{"url": "http://127.0.0.1:9"}], decode=[{"url": "http://127.0.0.1:9"}])
        self.admission = build_admission(config, cache_bytes=1 << 24)
        self.dialect = dialect_for(version)

    @property
    def chat_settings(self) -> ChatSettings:
        return self.admission.chat

    def dialects(self) -> frozenset[Dialect]:
        return frozenset({self.dialect})


def kvgate_answers(version: str, cases: list[dict[str, Any]]) -> dict[str, KvgateAnswer]:
    model = _Model(version)

    async def one(case: dict[str, Any]) -> KvgateAnswer:
        raw = orjson.dumps(case["body"])
        try:
            admitted = await admit_body(case["route"], raw, tenant="parity", find_model=lambda _name: model)
        except GatewayError as e:
            return KvgateAnswer(e.status, error=e.message)
        return KvgateAnswer(200, admitted.prompt_tokens[model.dialect], orjson.loads(admitted.engine_body))

    async def run() -> dict[str, KvgateAnswer]:
        return {str(c["id"]): await one(c) for c in cases}

    return asyncio.run(run())


@dataclass(frozen=True, slots=True)
class EmulatorAnswer:
    status: int
    ids: list[int] | None = None
    error: str | None = None


def emulator_answers(version: str, cases: list[dict[str, Any]]) -> dict[str, EmulatorAnswer]:
    """The emulator's parse and tokenize steps (`GenerationAPI._handle`: `fmt.parse`, `fmt.tokenize`) for each
    case, with the model directory SGLang's driver serves (template beside the tokenizer, no --chat-template)."""
    from loadtests.engine.dialect import dialect_of
    from loadtests.engine.errors import HTTPError
    from loadtests.engine.formats import NativeFormat
    from loadtests.engine.openai_formats import ChatFormat, CompletionFormat
    from loadtests.engine.tokenizer import PromptTokenizer

    dialect = dialect_of(version)
    tok = PromptTokenizer(str(build.GLM5 / "tokenizer.json.gz"), None, dialect)
    formats = {"/v1/chat/completions": ChatFormat(dialect, CONTEXT, tok.content_format),
               "/v1/completions": CompletionFormat(dialect), "/generate": NativeFormat()}

    async def one(case: dict[str, Any]) -> EmulatorAnswer:
        fmt = formats[case["route"]]
        try:
            spec = fmt.parse(orjson.loads(orjson.dumps(case["body"])))
            ids = await fmt.tokenize(tok, spec)
        except HTTPError as e:
            return EmulatorAnswer(e.status, error=e.message)
        except (ValueError, TypeError) as e:
            return EmulatorAnswer(400, error=str(e))
        return EmulatorAnswer(200, list(ids))

    async def run() -> dict[str, EmulatorAnswer]:
        try:
            return {str(c["id"]): await one(c) for c in cases}
        finally:
            tok.chat.close()

    return asyncio.run(run())
