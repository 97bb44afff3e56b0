"""The emulator counts chat prompts exactly as SGLang 0.5.8, 0.5.22 and 0.5.23 render them.

Each case writes, by hand from SGLang's serving_chat.py, the messages, tools and template kwargs SGLang hands
`apply_chat_template`, re-enacts that call with transformers, and compares with the emulator. Per dialect: a GLM-5
engine (its reported count), and a prefill/decode pair with a probe template that prints every message dict, the
tools and the thinking variables as JSON; its decode echoes the prompt, so the rendered text itself is compared
(a dropped key, a key order or a tool shape shows).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from loadtests.engine.harness import RunningEngine
from tests.emulator.helpers import VERSIONS, Reenactment, post, post_pd, start_engines, stop_all

pytestmark = pytest.mark.long_running(seconds=36)

PROBE = ("{#- vision: keeps SGLang's openai content format -#}\n"
         "messages={{ messages | tojson }}\n"
         "tools={{ tools | tojson }}\n"
         "{% if reasoning_effort is defined %}reasoning_effort={{ reasoning_effort | tojson }}\n{% endif %}"
         "{% if thinking is defined %}thinking={{ thinking | tojson }}\n{% endif %}"
         "{% if enable_thinking is defined %}enable_thinking={{ enable_thinking | tojson }}\n{% endif %}"
         "generation={{ add_generation_prompt }}")
MEDIUM = {"0.5.8": {"reasoning_effort": "medium"}, "0.5.22": {}, "0.5.23": {}}  # 0.5.8's field default
HI = {"role": "user", "content": "hi"}

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CLOCK_PARAMS = {"type": "object", "properties": {}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                            "parameters": WEATHER_PARAMS, "x-vendor": 1},
           "cache_control": {"type": "ephemeral"}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": CLOCK_PARAMS, "strict": True}}
# what each dialect renders for them: 0.5.8 the bare Function dump (strict injected, description null), 0.5.22 the
# Tool dump with a Tool-level defer_loading null, 0.5.23 the client's key order with strict only if sent
TOOLS = {
    "0.5.8": ({"description": "Current weather", "name": "get_weather", "parameters": WEATHER_PARAMS, "strict": False},
              {"description": None, "name": "get_time", "parameters": CLOCK_PARAMS, "strict": True}),
    "0.5.22": ({"type": "function", "function": {"description": "Current weather", "name": "get_weather",
                                                 "parameters": WEATHER_PARAMS, "strict": False},
                "defer_loading": None},
               {"type": "function", "function": {"description": None, "name": "get_time", "parameters": CLOCK_PARAMS,
                                                 "strict": True},
                "defer_loading": None}),
    "0.5.23": ({"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                                 "parameters": WEATHER_PARAMS},
                "defer_loading": None},
               {"type": "function", "function": {"name": "get_time", "parameters": CLOCK_PARAMS, "strict": True,
                                                 "description": None},
                "defer_loading": None}),
}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], RunningEngine]]:
    probe = tmp_path_factory.mktemp("probe") / "probe.jinja"
    probe.write_text(PROBE)
    specs = [("decode", {"version": v}) for v in VERSIONS]
    for v in VERSIONS:
        specs += [("prefill", {"version": v, "chat_template": str(probe)}),
                  ("decode", {"version": v, "chat_template": str(probe)})]
    names = [(v, "glm5") for v in VERSIONS] + [(v, half) for v in VERSIONS for half in ("probe-prefill", "probe")]
    engs = start_engines(specs)
    yield dict(zip(names, engs))
    stop_all(engs)


@pytest.fixture(scope="module")
def sglang(tmp_path_factory: pytest.TempPathFactory) -> Reenactment:
    return Reenactment(tmp_path_factory.mktemp("glm5"))


def prompt_tokens(engine: RunningEngine, body: dict[str, Any]) -> int:
    status, out = post(engine, "/v1/chat/completions", {**body, "max_tokens": 1})
    assert status == 200, out
    return out["usage"]["prompt_tokens"]


def probe_echo(engines: dict[tuple[str, str], RunningEngine], version: str, body: dict[str, Any],
               n: int) -> tuple[int, str]:
    """The probe pair's count and the text its decode generates: n tokens echo the n-token prompt it was handed."""
    out = post_pd(engines[version, "probe-prefill"], engines[version, "probe"], "/v1/chat/completions",
                  {**body, "max_tokens": n})
    return out["usage"]["prompt_tokens"], out["choices"][0]["message"]["content"]


def assert_counts(engines: dict[tuple[str, str], RunningEngine], sglang: Reenactment, version: str,
                  body: dict[str, Any], messages: list[dict[str, Any]], tools: list[Any] | None = None,
                  kwargs: dict[str, Any] | None = None, prefix: str | None = None) -> int:
    """The GLM-5 engine reports the count of SGLang's call, and the probe renders exactly SGLang's dicts (key order
    included); returns the GLM-5 count."""
    expected = sglang.ids(version, messages, tools, kwargs, prefix, PROBE)
    assert probe_echo(engines, version, body, len(expected)) == (len(expected), sglang.text(expected))
    expected = sglang.ids(version, messages, tools, kwargs, prefix)
    count = prompt_tokens(engines[version, "glm5"], body)
    assert count == len(expected), sglang.hf.decode(expected)
    return count


def assert_rejects(engine: RunningEngine, body: dict[str, Any], err_type: str, message: str,
                   status: int = 400) -> None:
    code, out = post(engine, "/v1/chat/completions", body)
    assert code == status, out
    assert out["object"] == "error" and out["type"] == err_type and out["code"] == status and out["param"] is None
    assert message in out["message"], out["message"]


@pytest.mark.parametrize("version", VERSIONS)
def test_unknown_fields_and_the_user_name_are_dropped(engines: Any, sglang: Reenactment, version: str) -> None:
    body = {"messages": [{"role": "system", "content": "Be brief.", "name": "policy", "cache_control": {"x": 1}},
                         {"role": "user", "content": "hi", "name": "bob", "refusal": None, "x": 1}],
            "documents": [{"title": "t", "text": "ignored top-level field"}]}
    kept = [{"role": "system", "content": "Be brief.", "name": "policy"}, {"role": "user", "content": "hi"}]
    assert_counts(engines, sglang, version, body, kept, kwargs=MEDIUM[version])


@pytest.mark.parametrize("version", VERSIONS)
def test_generic_roles_are_case_insensitive_and_user_is_not(engines: Any, sglang: Reenactment, version: str) -> None:
    body = {"messages": [{"role": "SYSTEM", "content": "Be brief."}, {"role": "user", "content": "hi"}]}
    assert_counts(engines, sglang, version, body, [{"role": "system", "content": "Be brief."}, HI],
                  kwargs=MEDIUM[version])
    assert_rejects(engines[version, "glm5"], {"messages": [{"role": "User", "content": "hi"}]}, "Bad Request",
                   "Input should be 'user'")


@pytest.mark.parametrize("version", VERSIONS)
def test_text_parts_stay_a_list_of_bare_text_parts(engines: Any, sglang: Reenactment, version: str) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello ", "cache_control": {}},
                                                      {"type": "text", "text": "world"}]},
                         {"role": "assistant", "content": [{"type": "text", "text": "Hi!"}]},
                         {"role": "user", "content": "again"}]}
    expected = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Hi!"}]},
                {"role": "user", "content": "again"}]
    assert_counts(engines, sglang, version, body, expected, kwargs=MEDIUM[version])


@pytest.mark.parametrize("version", VERSIONS)
def test_tool_text_parts_are_joined_from_0_5_22(engines: Any, sglang: Reenactment, version: str) -> None:
    body = {"messages": [HI, {"role": "tool", "tool_call_id": "call_1",
                              "content": [{"type": "text", "text": "sunny"}, {"type": "text", "text": "22C"}]}]}
    content: Any = "sunny 22C" if version != "0.5.8" else [{"type": "text", "text": "sunny"},
                                                            {"type": "text", "text": "22C"}]
    expected = [HI, {"role": "tool", "tool_call_id": "call_1", "content": content}]  # content moves last
    assert_counts(engines, sglang, version, body, expected, kwargs=MEDIUM[version])


@pytest.mark.parametrize("version", VERSIONS)
def test_media_parts_are_ignored_on_0_5_8_and_rejected_later(engines: Any, sglang: Reenactment, version: str) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}},
                                                      {"type": "text", "text": "What is this?"}]}]}
    if version == "0.5.8":
        expected = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
        assert_counts(engines, sglang, version, body, expected, kwargs=MEDIUM[version])
    else:
        assert_rejects(engines[version, "glm5"], body, "BadRequestError",
                       "Model only supports text input; received unsupported content type 'image_url'.")


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("choice", ["none", "auto", "required", "named", "default"])
def test_tool_choice_and_tool_shapes(engines: Any, sglang: Reenactment, version: str, choice: str) -> None:
    body: dict[str, Any] = {"messages": [HI], "tools": [WEATHER, CLOCK]}
    if choice == "named":
        body["tool_choice"] = {"type": "function", "function": {"name": "get_time"}}
    elif choice != "default":
        body["tool_choice"] = choice
    weather, clock = TOOLS[version]
    rendered = {"none": None, "auto": [weather, clock], "required": [weather, clock], "named": [clock],
                "default": [weather, clock]}[choice]
    assert_counts(engines, sglang, version, body, [HI], tools=rendered, kwargs=MEDIUM[version])


def test_the_tool_shape_differs_between_dialects(sglang: Reenactment) -> None:
    counts = {v: len(sglang.ids(v, [HI], list(TOOLS[v]), MEDIUM[v])) for v in VERSIONS}
    assert len(set(counts.values())) == 3, counts


@pytest.mark.parametrize("version", VERSIONS)
def test_tool_choice_validation(engines: Any, version: str) -> None:
    eng = engines[version, "glm5"]
    assert_rejects(eng, {"messages": [HI], "tool_choice": "required"}, "BadRequestError",
                   "Tools cannot be empty if tool choice is set to required.")
    assert_rejects(eng, {"messages": [HI], "tools": [WEATHER],
                         "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                   "BadRequestError", "Tool 'nope' not found in tools list.")
    assert_rejects(eng, {"messages": [HI], "tools": [{"function": {"name": "f", "parameters": {"type": "foo"}}}]},
                   "BadRequestError", "Tool 0 function has invalid 'parameters' schema")


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("arguments", ['{"city": "Paris"}', {"city": "Paris"}])
def test_tool_call_arguments_reach_the_template_as_objects(engines: Any, sglang: Reenactment, version: str,
                                                           arguments: Any) -> None:
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                               "arguments": arguments}}]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                         {"role": "user", "content": "Thanks"}]}
    expected = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [  # null content became "", nested nulls stay
                    {"id": "call_1", "index": None, "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
                {"role": "user", "content": "Thanks"}]
    assert_counts(engines, sglang, version, body, expected, kwargs=MEDIUM[version])


@pytest.mark.parametrize("version", VERSIONS)
def test_non_object_arguments(engines: Any, sglang: Reenactment, version: str) -> None:
    body = {"messages": [HI, {"role": "assistant", "content": "x", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "[1, 2]"}}]}, {"role": "user", "content": "more"}]}
    if version == "0.5.8":  # any JSON is parsed; GLM-5's template then fails on `.items()` (a jinja error: 400)
        assert_rejects(engines[version, "glm5"], body, "BadRequest", "has no attribute 'items'")
        expected = [HI, {"role": "assistant", "content": "x", "tool_calls": [
            {"id": "c", "index": None, "type": "function", "function": {"name": "f", "arguments": [1, 2]}}]},
            {"role": "user", "content": "more"}]
        ids = sglang.ids(version, expected, kwargs=MEDIUM[version], template=PROBE)
        assert probe_echo(engines, version, body, len(ids)) == (len(ids), sglang.text(ids))
    else:
        for name in ("glm5", "probe"):
            assert_rejects(engines[version, name], body, "BadRequest",
                           "Assistant tool call function.arguments must be a JSON object.")


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("flag", [None, False, True, "yes"])
def test_trailing_assistant_message(engines: Any, sglang: Reenactment, version: str, flag: Any) -> None:
    body: dict[str, Any] = {"messages": [HI, {"role": "assistant", "content": "Hello there, how"}]}
    if flag is not None:
        body["continue_final_message"] = flag
    if flag in (True, "yes"):  # cut off, rendered with the generation prompt, its ids appended
        count = assert_counts(engines, sglang, version, body, [HI], kwargs=MEDIUM[version],
                              prefix="Hello there, how")
        assert count == 10  # [gMASK]<sop><|user|>hi<|assistant|><think>Hello there, how
    else:  # turned into a user turn
        count = assert_counts(engines, sglang, version, body,
                              [HI, {"role": "user", "content": "Hello there, how"}], kwargs=MEDIUM[version])
        assert count == 11


@pytest.mark.parametrize("version", VERSIONS)
def test_reasoning_effort(engines: Any, sglang: Reenactment, version: str) -> None:
    high = {"reasoning_effort": "high"} if version == "0.5.8" else {
        "reasoning_effort": "high", "thinking": True, "enable_thinking": True}
    assert_counts(engines, sglang, version, {"messages": [HI], "reasoning_effort": "high"}, [HI], kwargs=high)
    # chat_template_kwargs.reasoning_effort is popped into the request field, unvalidated
    body = {"messages": [HI], "chat_template_kwargs": {"reasoning_effort": "low", "enable_thinking": False}}
    assert_counts(engines, sglang, version, body, [HI],
                  kwargs={"reasoning_effort": "low", "enable_thinking": False})
    if version == "0.5.8":
        assert_rejects(engines[version, "glm5"], {"messages": [HI], "reasoning_effort": "none"}, "Bad Request",
                       "reasoning_effort")
    else:  # "none" turns thinking off through the template variables
        none = {"reasoning_effort": "none", "thinking": False, "enable_thinking": False}
        assert assert_counts(engines, sglang, version, {"messages": [HI], "reasoning_effort": "none"}, [HI],
                             kwargs=none) == 6


@pytest.mark.parametrize("version", VERSIONS)
def test_reasoning_object_and_enable_thinking(engines: Any, sglang: Reenactment, version: str) -> None:
    thinking = {"thinking": True} if version == "0.5.8" else {"thinking": True, "enable_thinking": True}
    assert_counts(engines, sglang, version, {"messages": [HI], "reasoning": {"enabled": "yes"}}, [HI],
                  kwargs={**MEDIUM[version], **thinking})
    off = {"messages": [HI], "chat_template_kwargs": {"enable_thinking": False}}
    assert assert_counts(engines, sglang, version, off, [HI], kwargs={**MEDIUM[version], "enable_thinking": False}) == 6


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("knobs", "count_0_5_8"), [({"padding": "max_length", "max_length": 300}, 300),
                                                    ({"truncation": True, "max_length": 3}, 3),
                                                    ({"tokenizer_kwargs": {"split_special_tokens": True}}, 17)])
def test_tokenizer_knobs_in_chat_template_kwargs(engines: Any, sglang: Reenactment, version: str,
                                                 knobs: dict[str, Any], count_0_5_8: int) -> None:
    body = {"messages": [HI], "chat_template_kwargs": knobs}
    count = assert_counts(engines, sglang, version, body, [HI], kwargs={**MEDIUM[version], **knobs})
    # 0.5.8 tokenizes inside apply_chat_template, so the knobs change the ids; 0.5.22+ renders text, ignoring them
    assert count == (count_0_5_8 if version == "0.5.8" else 6)
    text = f"A fresh prompt after {knobs}, long enough to be cut by a leftover truncation."
    status, out = post(engines[version, "glm5"], "/generate", {"text": text})  # the knobs do not stick
    assert status == 200 and out["meta_info"]["prompt_tokens"] == len(sglang.text_ids(text))


@pytest.mark.parametrize("version", VERSIONS)
def test_request_chat_template(engines: Any, sglang: Reenactment, version: str) -> None:
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}" * 20
    body = {"messages": [HI], "chat_template_kwargs": {"chat_template": template}}
    if version == "0.5.8":
        count = assert_counts(engines, sglang, version, body, [HI],
                              kwargs={**MEDIUM[version], "chat_template": template})
        assert count == 80  # the request's template replaced the model's: 20 x "[user] hi\n"
    else:
        assert_rejects(engines[version, "glm5"], body, "BadRequestError",
                       "Request-supplied chat_template is not allowed.")


@pytest.mark.parametrize("version", VERSIONS)
def test_chat_input_ids_replace_the_messages_from_0_5_22(engines: Any, sglang: Reenactment, version: str) -> None:
    body = {"messages": [HI], "input_ids": [11, 12, 13, 14, 15]}
    if version == "0.5.8":
        assert assert_counts(engines, sglang, version, body, [HI], kwargs=MEDIUM[version]) == 6
    else:
        assert prompt_tokens(engines[version, "glm5"], body) == 5


@pytest.mark.parametrize("version", VERSIONS)
def test_lax_booleans_and_validation_errors(engines: Any, version: str) -> None:
    eng = engines[version, "glm5"]
    assert prompt_tokens(eng, {"messages": [HI, {"role": "assistant", "content": "Hello there, how"}],
                               "continue_final_message": "on"}) == 10
    assert_rejects(eng, {"messages": [HI], "continue_final_message": "maybe"}, "Bad Request", "valid boolean")
    assert_rejects(eng, {"messages": [{"role": "user", "content": None}]}, "Bad Request", "validation error")
    assert_rejects(eng, {"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "r"}]}]},
                   "Bad Request", "validation error")
