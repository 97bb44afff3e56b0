"""SGLang's OpenAI request models (`entrypoints/openai/protocol.py`), re-implemented per dialect.

What matters for the prompt is mirrored exactly: pydantic's default `extra="ignore"` (unknown fields vanish at every
level), lax scalars (`"yes"` is true), the user/generic message split, the content-part unions, the tool shapes and
their `model_dump`, and the "before" validators that rewrite the raw request. Sampling fields are typed as SGLang
types them, so a wrong type is the same 400; fields that cannot change the prompt and are rarely sent are left out.
"""

# No `from __future__ import annotations`: the models are built inside a factory and pydantic must resolve their
# annotations from its locals.

from dataclasses import dataclass
from functools import cache
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, Field, TypeAdapter, field_validator, model_serializer, model_validator

from .dialect import Dialect


class StreamOptions(BaseModel):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class ToolChoiceFuncName(BaseModel):
    name: Optional[str] = None


class ToolChoice(BaseModel):
    function: ToolChoiceFuncName
    type: Literal["function"] = "function"


class FunctionResponse(BaseModel):
    name: Optional[str] = None
    arguments: Optional[Union[str, Dict[str, Any]]] = None


class ToolCall(BaseModel):
    id: Optional[str] = None
    index: Optional[int] = None
    type: Literal["function"] = "function"
    function: FunctionResponse


class ChatCompletionMessageContentTextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatCompletionMessageContentAudioURL(BaseModel):
    url: str


class ChatCompletionMessageContentAudioURLPart(BaseModel):
    type: Literal["audio_url"]
    audio_url: ChatCompletionMessageContentAudioURL


class ChatCompletionMessageContentAudioPart(ChatCompletionMessageContentAudioURLPart):
    """0.5.8's name for the same part (names show in validation errors)."""


class ChatCompletionMessageContentThinkingPart(BaseModel):  # 0.5.22+
    type: Literal["thinking", "reasoning"]
    thinking: Optional[str] = None
    text: Optional[str] = None

    @model_validator(mode="after")
    def validate_payload(self) -> "ChatCompletionMessageContentThinkingPart":
        if (self.thinking is None) == (self.text is None):
            raise ValueError("thinking parts require exactly one of 'thinking' or 'text'")
        return self


class ChatCompletionMessageContentInputAudio(BaseModel):  # 0.5.22+
    data: str
    format: Literal["wav", "mp3"]


class ChatCompletionMessageContentAudioInlinePart(BaseModel):
    type: Literal["input_audio"]
    input_audio: ChatCompletionMessageContentInputAudio


_AudioParts = Union[ChatCompletionMessageContentAudioURLPart, ChatCompletionMessageContentAudioInlinePart]


def _to_audio_url_part(part: _AudioParts) -> ChatCompletionMessageContentAudioURLPart:
    # 0.5.22+ turns inline audio into the equivalent data-URI audio_url part while validating
    if isinstance(part, ChatCompletionMessageContentAudioURLPart):
        return part
    mime = {"wav": "audio/wav", "mp3": "audio/mpeg"}[part.input_audio.format]
    url = ChatCompletionMessageContentAudioURL(url=f"data:{mime};base64,{part.input_audio.data}")
    return ChatCompletionMessageContentAudioURLPart(type="audio_url", audio_url=url)


class ChatCompletionMessageContentToolReferenceBlock(BaseModel):  # 0.5.22+, GLM extension
    type: Literal["tool_reference"]
    name: str


@dataclass(frozen=True)
class OpenAIModels:
    chat: type[BaseModel]
    completion: type[BaseModel]


def _no_thinking_parts(content: Any) -> None:
    if isinstance(content, list) and any(isinstance(p, ChatCompletionMessageContentThinkingPart) for p in content):
        raise ValueError("thinking content parts are only valid in assistant messages")


@cache
def models_for(d: Dialect) -> OpenAIModels:
    """The request models of one dialect (each class mirrors the protocol.py one; version differences inline)."""
    new = d >= Dialect.V0_5_22
    newest = d >= Dialect.V0_5_23
    roles = ("system", "assistant", "tool", "function", "developer") + (("latest_reminder",) if new else ()) \
        + (("root",) if newest else ())

    class ChatCompletionMessageContentImageURL(BaseModel):
        url: str
        detail: Optional[Literal["auto", "low", "high"]] = "auto"
        max_dynamic_patch: Optional[int] = None
        min_dynamic_patch: Optional[int] = None
        if newest:
            max_long_side_pixel: Optional[int] = None
        if new:
            content_hash: Optional[str] = None

        if newest:
            @field_validator("detail", mode="before")
            @classmethod
            def _default_detail_is_auto(cls, v: Any) -> Any:
                return "auto" if v == "default" else v

    def positive() -> Any:  # 0.5.23 bounds these
        return Field(default=None, gt=0) if newest else None

    class ChatCompletionMessageContentVideoURL(BaseModel):
        url: str
        max_dynamic_patch: Optional[int] = None
        min_dynamic_patch: Optional[int] = None
        if new:
            fps: Optional[float] = Field(default=None, gt=0, allow_inf_nan=False) if newest else None
            max_frames: Optional[int] = positive()
            max_tokens_per_frame: Optional[int] = positive()
            max_image_tokens: Optional[int] = positive()
        if newest:
            max_long_side_pixel: Optional[int] = None

    class ChatCompletionMessageContentImagePart(BaseModel):
        type: Literal["image_url"]
        image_url: ChatCompletionMessageContentImageURL
        modalities: Optional[Literal["image", "multi-images", "video"]] = "image"

    class ChatCompletionMessageContentVideoPart(BaseModel):
        type: Literal["video_url"]
        video_url: ChatCompletionMessageContentVideoURL

    if new:
        Part = Union[ChatCompletionMessageContentTextPart, ChatCompletionMessageContentThinkingPart,
                     ChatCompletionMessageContentImagePart, ChatCompletionMessageContentVideoPart,
                     Annotated[_AudioParts, AfterValidator(_to_audio_url_part)],
                     ChatCompletionMessageContentToolReferenceBlock]
    else:
        Part = Union[ChatCompletionMessageContentTextPart, ChatCompletionMessageContentImagePart,
                     ChatCompletionMessageContentVideoPart, ChatCompletionMessageContentAudioPart]

    class Function(BaseModel):
        description: Optional[str] = None
        name: str
        parameters: Optional[object] = None
        if newest:
            strict: Optional[bool] = None
        else:
            strict: bool = False  # type: ignore[no-redef]
        if new:
            defer_loading: Optional[bool] = None
        if newest:
            key_order: List[str] = Field(default_factory=list, exclude=True)

            @model_validator(mode="before")
            @classmethod
            def _capture_key_order(cls, data: Any) -> Any:
                if isinstance(data, dict):
                    data = {**data, "key_order": list(data)}
                return data

        if new:
            # 0.5.22 drops only its own null defer_loading; 0.5.23 also an unsent strict, and keeps the client's
            # key order with missing fields appended
            @model_serializer(mode="wrap")
            def _serialize(self, handler: Any) -> Any:
                data = handler(self)
                if self.defer_loading is None:
                    data.pop("defer_loading", None)
                if newest:
                    if self.strict is None:
                        data.pop("strict", None)
                    if self.key_order:
                        order = self.key_order + [k for k in data if k not in self.key_order]
                        data = {k: data[k] for k in order if k in data}
                return data

    class Tool(BaseModel):
        type: str = "function"
        function: Function
        if new:
            defer_loading: Optional[bool] = None

            @model_validator(mode="after")
            def _propagate_defer_loading(self) -> Any:
                if self.defer_loading is not None and self.function.defer_loading is None:
                    self.function.defer_loading = self.defer_loading
                return self

    MessageTool = Tool if new else Any  # 0.5.8: see _responses_api_tools

    class ChatCompletionMessageGenericParam(BaseModel):
        role: Literal[roles]  # type: ignore[valid-type]
        content: Union[str, List[Part], None] = None  # type: ignore[valid-type]
        tool_call_id: Optional[str] = None
        name: Optional[str] = None
        if new:
            phase: Optional[Literal["commentary", "final_answer"]] = None
        reasoning_content: Optional[str] = None
        tool_calls: Optional[List[ToolCall]] = None
        tools: Optional[List[MessageTool]] = None  # type: ignore[valid-type]
        if newest:
            prefix: Optional[bool] = None

        if not new:
            @field_validator("tools")
            @classmethod
            def _responses_api_tools(cls, v: Any) -> Any:
                return None if v is None else _responses_tool_list().validate_python(v)

        @field_validator("role", mode="before")
        @classmethod
        def _normalize_role(cls, v: Any) -> Any:
            if not isinstance(v, str):
                raise ValueError("'role' must be a string")
            if v.lower() not in roles:
                if not new:
                    raise ValueError("'role' must be one of 'system', 'developer', 'assistant', 'tool', or 'function' "
                                     "(case-insensitive).")
                raise ValueError(f"'role' must be one of {', '.join(map(repr, roles))} (case-insensitive).")
            return v.lower()

        if new:
            @model_validator(mode="after")
            def validate_thinking_parts_role(self) -> Any:
                if self.role != "assistant":
                    _no_thinking_parts(self.content)
                return self

    class ChatCompletionMessageUserParam(BaseModel):
        role: Literal["user"]
        content: Union[str, List[Part]]  # type: ignore[valid-type]

        if new:
            @model_validator(mode="after")
            def validate_thinking_parts_role(self) -> Any:
                _no_thinking_parts(self.content)
                return self

    efforts = ("none", "minimal", "low", "medium", "high", "xhigh") + (("ultra",) if newest else ()) + ("max",)
    if new:
        Effort = Optional[Union[Literal[efforts], Annotated[float, Field(ge=0.0, le=0.99, allow_inf_nan=False)]]]
    else:
        Effort = Optional[Literal["low", "medium", "high"]]

    class ChatCompletionRequest(BaseModel):
        messages: List[Union[ChatCompletionMessageGenericParam, ChatCompletionMessageUserParam]]
        model: str = "default"
        frequency_penalty: float = 0.0
        logit_bias: Optional[Dict[str, float]] = None
        logprobs: bool = False
        top_logprobs: Optional[int] = None
        max_tokens: Optional[int] = None
        max_completion_tokens: Optional[int] = None
        n: int = 1
        presence_penalty: float = 0.0
        seed: Optional[int] = None
        stop: Optional[Union[str, List[str]]] = None
        stream: bool = False
        stream_options: Optional[StreamOptions] = None
        temperature: Optional[float] = None
        top_p: Optional[float] = None
        user: Optional[str] = None
        tools: Optional[List[Tool]] = None
        tool_choice: Union[ToolChoice, Literal["auto", "required", "none"]] = "auto"
        if new:
            parallel_tool_calls: bool = True
        reasoning_effort: Effort = None if new else "medium"  # type: ignore[valid-type]
        top_k: Optional[int] = None
        min_p: Optional[float] = None
        min_tokens: int = 0
        regex: Optional[str] = None
        ebnf: Optional[str] = None
        repetition_penalty: Optional[float] = None
        stop_token_ids: Optional[List[int]] = None
        no_stop_trim: bool = False
        ignore_eos: bool = False
        continue_final_message: bool = False
        skip_special_tokens: bool = True
        separate_reasoning: bool = True
        stream_reasoning: bool = True
        chat_template_kwargs: Optional[Dict] = None
        if new:
            input_ids: Optional[List[int]] = None
        rid: Optional[Union[List[str], str]] = None
        priority: Optional[int] = None
        bootstrap_host: Optional[Union[List[str], str]] = None
        bootstrap_port: Optional[Union[List[Optional[int]], int]] = None
        bootstrap_room: Optional[Union[List[int], int]] = None

        @model_validator(mode="before")
        @classmethod
        def set_tool_choice_default(cls, values: Any) -> Any:
            # sglang ChatCompletionRequest.set_tool_choice_default
            if values.get("tool_choice") is None:
                has_tools = values.get("tools") is not None or (new and _has_message_level_tools(values, newest))
                values["tool_choice"] = "auto" if has_tools else "none"
            return values

        @model_validator(mode="before")
        @classmethod
        def normalize_reasoning_inputs(cls, values: Any) -> Any:
            # sglang ChatCompletionRequest.normalize_reasoning_inputs
            return _normalize_reasoning(values, d)

        if new:
            @field_validator("reasoning_effort", mode="before")
            @classmethod
            def validate_reasoning_effort_type(cls, v: Any) -> Any:
                if isinstance(v, bool):
                    raise ValueError("reasoning_effort must not be a boolean")
                return v

    class CompletionRequest(BaseModel):
        model: str = "default"
        prompt: Union[List[int], List[List[int]], str, List[str]]
        echo: bool = False
        logprobs: Optional[int] = None
        max_tokens: int = 16
        n: int = 1
        stream: bool = False
        stream_options: Optional[StreamOptions] = None
        rid: Optional[Union[List[str], str]] = None
        bootstrap_host: Optional[Union[List[str], str]] = None
        bootstrap_port: Optional[Union[List[Optional[int]], int]] = None
        bootstrap_room: Optional[Union[List[int], int]] = None

        @field_validator("max_tokens")
        @classmethod
        def validate_max_tokens_positive(cls, v: int) -> int:
            if v <= 0:
                raise ValueError("max_tokens must be positive")
            return v

    return OpenAIModels(ChatCompletionRequest, CompletionRequest)


@cache
def _responses_tool_list() -> TypeAdapter[Any]:
    """0.5.8's message `tools` annotation resolves to the openai SDK's Responses-API `Tool` union (a name clash in
    its protocol.py), not its own Tool; imported on first use, as the SDK takes about 0.4 s to import."""
    from openai.types.responses.tool import Tool as ResponsesTool

    return TypeAdapter(List[ResponsesTool])


def _has_message_level_tools(values: dict[str, Any], newest: bool) -> bool:
    messages = values.get("messages")
    hosts = ("root", "system", "developer") if newest else ("system", "developer")
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("role"), str) and m["role"].lower() in hosts and bool(m.get("tools"))
        for m in messages)


_TRUE_WORDS = {"1", "true", "yes", "y", "on"}
_EFFORTS_0_5_22 = {"none", "minimal", "low", "medium", "high", "xhigh", "max"}


def _normalize_reasoning(values: dict[str, Any], d: Dialect) -> dict[str, Any]:
    """The `reasoning` object (and, 0.5.22+, any non-null effort) seeds `chat_template_kwargs`."""
    r = values.get("reasoning")
    thinking = None
    if isinstance(r, dict):
        if d >= Dialect.V0_5_22:
            effort = r.get("effort")
            if effort is None:
                effort = r.get("reasoning_effort")
            known = _EFFORTS_0_5_22 | ({"ultra"} if d >= Dialect.V0_5_23 else set())
            if isinstance(effort, str) and effort in known:
                values["reasoning_effort"] = effort
            elif isinstance(effort, (int, float)) and not isinstance(effort, bool):
                values["reasoning_effort"] = float(effort)
            elif isinstance(effort, str):
                try:
                    values["reasoning_effort"] = float(effort)
                except ValueError as exc:
                    raise ValueError(f"invalid reasoning effort: {effort!r}") from exc
            elif effort is not None:
                raise ValueError(f"invalid reasoning effort: {effort!r}")
        else:
            effort = r.get("effort") or r.get("reasoning_effort")
            if effort in {"low", "medium", "high"}:
                values["reasoning_effort"] = effort
        enabled = r.get("enabled") if r.get("enabled") is not None else r.get("enable", False)
        if isinstance(enabled, str):
            enabled = enabled.strip().lower() in _TRUE_WORDS
        if enabled:
            thinking = True
    if d >= Dialect.V0_5_22 and values.get("reasoning_effort") is not None:
        thinking = values["reasoning_effort"] != "none"
    if thinking is not None:
        ctk = values.get("chat_template_kwargs")
        if not isinstance(ctk, dict):
            ctk = {}
        ctk.setdefault("thinking", thinking)
        if d >= Dialect.V0_5_22:  # "enable_thinking" is what qwen3/glm templates read
            ctk.setdefault("enable_thinking", thinking)
        values["chat_template_kwargs"] = ctk
    return values
