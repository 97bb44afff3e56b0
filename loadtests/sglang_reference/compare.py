"""kvgate, the emulator and SGLang's own code on the same cases: what must agree, and the listed differences.

Rules, per SGLang version:
- a request both serve: kvgate's count == len(SGLang's prompt ids) for the client's body, and SGLang's count of
  the body kvgate forwards is that same number (what is forwarded is exactly what was counted);
- a request SGLang refuses: kvgate refuses it too (400), unless `KNOWN` lists the difference with its reason;
- a request kvgate refuses that SGLang serves: listed in `KNOWN` with its reason;
- the emulator (`loadtests.engine`) gives SGLang's ids, or refuses what SGLang refuses, unless `KNOWN` lists it.
A difference found but not listed fails; a listed one that no longer occurs fails too (the list stays true).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .kvgate_side import EmulatorAnswer, KvgateAnswer
from .reference import Answer


def _tool_choice_forced(body: dict[str, Any]) -> bool:
    choice = body.get("tool_choice")
    return choice == "required" or isinstance(choice, dict)


def _template_kwarg(name: str) -> Callable[[dict[str, Any]], bool]:
    return lambda body: name in (body.get("chat_template_kwargs") or {})


@dataclass(frozen=True)
class Known:
    kind: str        # "sglang_refuses" (kvgate serves), "kvgate_refuses" (SGLang serves), "emulator"
    versions: tuple[str, ...]
    route: str
    matches: Callable[[dict[str, Any]], bool]
    reason: str


ALL = ("0.5.8", "0.5.22", "0.5.23")
CHAT = "/v1/chat/completions"

KNOWN: list[Known] = [
    Known("sglang_refuses", ("0.5.22", "0.5.23"), CHAT,
          lambda b: _tool_choice_forced(b) and b.get("response_format") is not None,
          "0.5.22 and 0.5.23 `protocol.ChatCompletionRequest.to_sampling_params` refuse tool_choice 'required' or a "
          "named tool when a tool-call constraint meets an output constraint (response_format, regex, ebnf): "
          "'cannot both be honored' (it depends on the server's tool-call parser, not on the prompt); kvgate serves "
          "and forwards it, and the engine answers its 400 (passed to the client as a 400). Not a count difference: "
          "nothing is scheduled."),
    Known("emulator", ("0.5.22", "0.5.23"), CHAT,
          lambda b: _tool_choice_forced(b) and b.get("response_format") is not None,
          "the emulator does not emulate 0.5.22+'s tool_choice + response_format refusal (same as above); its "
          "ids for the request equal what kvgate counted."),
    Known("kvgate_refuses", ALL, CHAT, _template_kwarg("thinking"),
          "kvgate accepts only the chat_template_kwargs its model allows (by default the variables GLM-5's "
          "template reads); `thinking` is not one of them. SGLang passes any key to the template (unused here)."),
    Known("kvgate_refuses", ALL, CHAT, _template_kwarg("reasoning_effort"),
          "kvgate takes reasoning_effort only as the top-level field; SGLang pops it out of chat_template_kwargs "
          "(`_convert_to_internal_request`), unvalidated on 0.5.8."),
    Known("kvgate_refuses", ("0.5.22", "0.5.23"), CHAT,
          lambda b: b.get("reasoning_effort") not in (None, "low", "medium", "high"),
          "kvgate accepts the reasoning_effort values valid in every dialect (low, medium, high); 0.5.22+ also "
          "take none/minimal/xhigh/max, which also set thinking flags (`normalize_reasoning_inputs`)."),
    Known("kvgate_refuses", ALL, "/v1/completions",
          lambda b: isinstance(b.get("prompt"), list) and b["prompt"] and isinstance(b["prompt"][0], list),
          "kvgate refuses batched prompts, a list of one id list included; SGLang serves it as a batch of one."),
    Known("kvgate_refuses", ALL, "/generate", lambda b: "text" in b and "input_ids" in b,
          "kvgate refuses text together with input_ids (ambiguous to a client); SGLang ignores the text "
          "(`TokenizerManager._tokenize_one_request`: input_ids first)."),
]


@dataclass
class Report:
    version: str
    served_equal: int = 0
    both_refuse: int = 0
    failures: list[str] | None = None
    listed: dict[str, list[str]] | None = None   # reason -> case ids

    def __post_init__(self) -> None:
        self.failures = []
        self.listed = {}


def _known(kind: str, version: str, case: dict[str, Any]) -> Known | None:
    for entry in KNOWN:
        if entry.kind == kind and version in entry.versions and entry.route == case["route"] \
                and entry.matches(case["body"]):
            return entry
    return None


def compare(version: str, cases: list[dict[str, Any]], sglang: dict[str, Answer], kvgate: dict[str, KvgateAnswer],
            forwarded: dict[str, Answer], emulator: dict[str, EmulatorAnswer] | None) -> Report:
    report = Report(version)
    assert report.failures is not None and report.listed is not None
    used: set[int] = set()

    def fail(case: dict[str, Any], what: str) -> None:
        assert report.failures is not None
        report.failures.append(f"{case['id']} {case['route']}: {what}\n    body: {case['body']}")

    def listed(kind: str, case: dict[str, Any], what: str) -> None:
        entry = _known(kind, version, case)
        if entry is None:
            fail(case, what)
            return
        used.add(id(entry))
        assert report.listed is not None
        report.listed.setdefault(f"{kind}: {entry.reason}", []).append(case["id"])

    for case in cases:
        cid = case["id"]
        s, k = sglang[cid], kvgate[cid]
        if s.status == 200 and k.status == 200:
            assert s.ids is not None
            if k.count != len(s.ids):
                fail(case, f"COUNT DIFFERS: kvgate {k.count}, SGLang {len(s.ids)}")
            f = forwarded.get(cid)
            if f is None or f.status != 200 or f.ids is None or len(f.ids) != k.count:
                fail(case, f"FORWARDED BODY: SGLang answers {f and f.status} with "
                           f"{f and f.ids and len(f.ids)} tokens for what kvgate forwards, kvgate counted {k.count}")
            else:
                report.served_equal += 1
        elif s.status == 200:
            listed("kvgate_refuses", case, f"kvgate refuses ({k.status}: {k.error}), SGLang serves "
                                           f"{len(s.ids or [])} tokens")
        elif k.status == 200:
            listed("sglang_refuses", case, f"SGLang refuses ({s.status}: {(s.error or '')[:300]}), kvgate serves "
                                           f"{k.count} tokens")
        else:
            report.both_refuse += 1
        if emulator is not None:
            e = emulator[cid]
            agrees = (e.status == 200) == (s.status == 200) and (s.status != 200 or e.ids == s.ids)
            if not agrees:
                listed("emulator", case, f"emulator {e.status} ({len(e.ids or [])} ids: {e.error}), SGLang "
                                         f"{s.status} ({len(s.ids or [])} ids)")
    for entry in KNOWN:
        if version in entry.versions and id(entry) not in used and _applies(entry, cases):
            report.failures.append(f"listed difference no longer seen on {version}: {entry.kind}: {entry.reason}")
    return report


def _applies(entry: Known, cases: list[dict[str, Any]]) -> bool:
    return any(c["route"] == entry.route and entry.matches(c["body"]) for c in cases)
