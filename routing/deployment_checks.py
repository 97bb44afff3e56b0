"""The incident's deployment gate beyond the pool: transfer-safety settings and version skew, per worker, from what
`/server_info` reveals (SGLang 0.5.8 / 0.5.22 / 0.5.23; the sources are cited in README's checklist).

Each check is pass, fail or unverified (the engine does not reveal the value: an older version, or environment
variables not exposed with SGLANG_EXPOSE_OWN_ENV_VARS=1, where a variable that is absent is at its default). A
failure counts under the check's policy — `refuse` keeps the worker out of rotation, `warn` only reports — and an
unverified transfer setting fails only when the model requires verified transfer settings.

Settings that must agree across a model's workers are compared with the value most of them share: one worker that
differs is the one that fails, so a single bad joiner cannot take a healthy fleet out; with no majority (one
prefill and one decode that disagree) every worker that differs from another fails. Pure functions, no I/O."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from routing.engines.identity import RANKS_DISAGREE, EngineIdentity, release_at_least, same_release

Result = Literal["pass", "fail", "unverified"]
Policy = Literal["warn", "refuse"]

# Backends as ServerArgs resolves them (0.5.8 reports `mooncake_tcp` as given); ascend's manager is mooncake's.
_BACKEND_ALIASES = {"mooncake_tcp": "mooncake"}
REAL_BACKENDS = frozenset({"mooncake", "nixl", "mori", "ascend"})
_BOUNDED_BACKENDS = frozenset({"mooncake", "ascend"})  # MooncakeKVManager and its subclass read the batch bound
DEFERRED_RELEASE = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
RELEASE_TIMEOUT = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"
BATCH_BOUND = "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES"
CUSTOM_MEM_POOL = "SGLANG_MOONCAKE_CUSTOM_MEM_POOL"
DEFAULT_RELEASE_TIMEOUT_S = 30.0  # environ.py, 0.5.22 and 0.5.23
# SGLang's EnvBool: lowercased (not stripped), these exact spellings, anything else falls back to the default.
_ENV_TRUE = frozenset({"true", "1", "yes", "y"})
_ENV_FALSE = frozenset({"false", "0", "no", "n"})
# Checks of transfer settings read from the environment: the ones `require_verified_transfer_settings` is about.
TRANSFER_SETTINGS = frozenset({"deferred_kv_release", "transfer_batch_bound", "release_timeout"})
# Default template kwargs kvgate cannot apply by merging, whatever admission says besides: those SGLang moves out of
# chat_template_kwargs (serving_chat.py, 0.5.23).
_MOVED_DEFAULTS = frozenset({"reasoning_effort", "chat_template"})


@dataclass(frozen=True, slots=True)
class CheckPolicy:
    """What each check's failure does, per model (YAML `deployment_checks`)."""

    version_skew: Policy = "warn"
    transfer_backend: Policy = "refuse"
    role_settings_match: Policy = "refuse"
    deferred_kv_release: Policy = "warn"
    transfer_batch_bound: Policy = "warn"
    release_timeout: Policy = "warn"
    metrics_enabled: Policy = "warn"
    engine_chat_rendering: Policy = "refuse"
    require_verified_transfer_settings: bool = False
    require_kv_checksum: bool = False
    transfer_timeout_s: float = 30.0  # the operator's worst-case KV transfer (Mooncake's MC_TRANSFER_TIMEOUT: 30 s)
    chat_template_configured: bool = False  # the model's own `chat_template` (kvgate renders with that file)
    # Keys that are not template variables (apply_chat_template's parameters): as engine defaults they change the
    # call itself; admission knows which (gateway.admission.chat).
    unmergeable_template_kwargs: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class CheckOutcome:
    check: str
    result: Result
    value: str  # what the engine reported (or why it could not be read)
    safe: str   # what would pass
    policy: Policy

    def text(self) -> str:
        return f"{self.check}: {self.result} ({self.value}; safe: {self.safe})"


def check_worker(role: str, identity: EngineIdentity, fleet: Sequence[EngineIdentity],
                 policy: CheckPolicy) -> list[CheckOutcome]:
    """Every check for one worker; `fleet` is the identities of all the model's readable workers (itself included)."""
    checks = [
        _version_skew(identity, fleet, policy),
        _backend(identity, fleet, policy),
        _checksum(identity, fleet, policy),
        _agreeing("decode_allocation_policy_match", identity, fleet, _allocation_policy, policy),
        _deferred_release(identity, policy),
    ]
    checks.append(_batch_bound(identity, policy) if role == "prefill" else _release_timeout(identity, policy))
    checks.append(_chat_rendering(identity, fleet, policy))
    metrics = identity.settings.metrics_enabled
    checks.append(CheckOutcome("metrics_enabled", "unverified" if metrics is None else "pass" if metrics else "fail",
                               "not reported" if metrics is None else str(metrics).lower(), "true (--enable-metrics)",
                               policy.metrics_enabled))
    return checks


def _chat_rendering(identity: EngineIdentity, fleet: Sequence[EngineIdentity], policy: CheckPolicy) -> CheckOutcome:
    """kvgate counts the prompt it renders; an engine that renders with settings of its own tokenizes another one.
    Default template kwargs kvgate applies itself (GLM's `clear_thinking: false` renders every earlier turn's
    reasoning: it must be counted), when every worker has the same and none is a key SGLang moves elsewhere
    (`reasoning_effort`, `chat_template`). An engine-side chat template passes only when the model names its own
    `chat_template` for kvgate, the operator's statement that both render with the same file."""
    rendering = identity.rendering
    found = []
    own = rendering.default_chat_template_kwargs or "unset"
    values = [i.rendering.default_chat_template_kwargs or "unset" for i in fleet]
    parsed = json.loads(own) if own != "unset" else {}
    unmergeable = _MOVED_DEFAULTS | policy.unmergeable_template_kwargs
    unusable = sorted(set(parsed) & unmergeable) if isinstance(parsed, dict) else ["not an object"]
    if unusable:
        found.append(f"--default-chat-template-kwargs {own}: {', '.join(unusable)} cannot be applied by merging")
    elif _deviates(own, values):  # kvgate applies one set of defaults: the model's workers must share it
        found.append(f"--default-chat-template-kwargs {own}{_others(own, values)}")
    if rendering.chat_template and not policy.chat_template_configured:
        found.append(f"--chat-template {rendering.chat_template} (kvgate renders with the tokenizer's own)")
    if rendering.completion_template:
        found.append(f"--completion-template {rendering.completion_template}")
    safe = ("the same --default-chat-template-kwargs (if any) on every worker, no --completion-template, and a "
            "--chat-template only with the same file as the model's chat_template")
    return CheckOutcome("engine_chat_rendering", "fail" if found else "pass", "; ".join(found) or "none", safe,
                        policy.engine_chat_rendering)


# ── settings that must agree across the model's workers ─────────────────────────────────────────────────────
def _deviates(value: str, values: Sequence[str]) -> bool:
    """Whether `value` differs from what most of the fleet has (without a majority: from any other value)."""
    counts = Counter(values).most_common()
    if len(counts) <= 1:
        return False
    if counts[0][1] > counts[1][1]:
        return value != counts[0][0]
    return True


def _others(value: str, values: Sequence[str]) -> str:
    different = sorted({v for v in values if v != value})
    return f" vs {', '.join(different)} elsewhere in the model" if different else ""


def _version_skew(identity: EngineIdentity, fleet: Sequence[EngineIdentity], policy: CheckPolicy) -> CheckOutcome:
    safe = "the same SGLang version on every prefill and decode"
    own = identity.version.split("+")[0].strip()
    versions = [i.version.split("+")[0].strip() for i in fleet]
    roles = {i.disaggregation_mode for i in fleet}
    if not {"prefill", "decode"} <= roles:
        return CheckOutcome("version_skew", "unverified", f"{identity.version}; the other role was not read", safe,
                            policy.version_skew)
    skewed = any(not same_release(identity.version, other.version) for other in fleet) and _deviates(own, versions)
    return CheckOutcome("version_skew", "fail" if skewed else "pass", own + _others(own, versions), safe,
                        policy.version_skew)


def _backend_name(identity: EngineIdentity) -> str | None:
    backend = identity.settings.backend
    if backend is None:
        return None
    name = backend.strip().lower()
    return _BACKEND_ALIASES.get(name, name)


def _backend(identity: EngineIdentity, fleet: Sequence[EngineIdentity], policy: CheckPolicy) -> CheckOutcome:
    safe = f"one of {', '.join(sorted(REAL_BACKENDS))}, the same everywhere"
    own = _backend_name(identity)
    if own is None:
        return CheckOutcome("transfer_backend", "unverified", "not reported", safe, policy.transfer_backend)
    values = [name for i in fleet if (name := _backend_name(i)) is not None]
    ok = own in REAL_BACKENDS and not _deviates(own, values)
    return CheckOutcome("transfer_backend", "pass" if ok else "fail", own + _others(own, values), safe,
                        policy.transfer_backend)


def _checksum_value(identity: EngineIdentity) -> str:
    """The effective setting: an engine without the field (SGLang < 0.5.22) computes no checksum."""
    checksum = identity.settings.kv_checksum
    return "false" if checksum is None else str(checksum).lower()


def _allocation_policy(identity: EngineIdentity) -> str:
    policy = identity.settings.decode_allocation_policy
    return "early" if policy is None else policy.strip().lower()  # before 0.5.22: allocation is always early


def _checksum(identity: EngineIdentity, fleet: Sequence[EngineIdentity], policy: CheckPolicy) -> CheckOutcome:
    outcome = _agreeing("kv_checksum_match", identity, fleet, _checksum_value, policy)
    if outcome.result == "pass" and policy.require_kv_checksum and _checksum_value(identity) != "true":
        return CheckOutcome(outcome.check, "fail", outcome.value, "true on every worker (required)",
                            policy.role_settings_match)
    return outcome


def _agreeing(name: str, identity: EngineIdentity, fleet: Sequence[EngineIdentity],
              read: Callable[[EngineIdentity], str], policy: CheckPolicy) -> CheckOutcome:
    """A setting every worker must share, compared by its effective value (a field missing before 0.5.22 counts as
    that version's behaviour)."""
    own = read(identity)
    values = [read(i) for i in fleet]
    old = release_at_least(identity.version, (0, 5, 22)) is False
    shown = own + (" (not reported before 0.5.22: its behaviour)" if old else "")
    ok = not _deviates(own, values)
    return CheckOutcome(name, "pass" if ok else "fail", shown + _others(own, values),
                        "the same on every prefill and decode", policy.role_settings_match)


# ── settings read from the exposed environment ──────────────────────────────────────────────────────────────
def _env(identity: EngineIdentity) -> dict[str, str] | None:
    exposed = identity.settings.env_vars
    return dict(exposed) if exposed is not None else None


def _deferred_release(identity: EngineIdentity, policy: CheckPolicy) -> CheckOutcome:
    safe = f"{DEFERRED_RELEASE} not false (default true since 0.5.22)"
    modern = release_at_least(identity.version, (0, 5, 22))
    if modern is None:
        return CheckOutcome("deferred_kv_release", "unverified", f"SGLang {identity.version}: its default is not "
                            "known", safe, policy.deferred_kv_release)
    if not modern:
        return CheckOutcome("deferred_kv_release", "fail", f"absent in SGLang {identity.version}", safe,
                            policy.deferred_kv_release)
    env = _env(identity)
    if env is None:
        return CheckOutcome("deferred_kv_release", "unverified", "environment not exposed", safe,
                            policy.deferred_kv_release)
    raw = env.get(DEFERRED_RELEASE)
    if raw is None:
        return CheckOutcome("deferred_kv_release", "pass", "true (default)", safe, policy.deferred_kv_release)
    if raw == RANKS_DISAGREE:
        return CheckOutcome("deferred_kv_release", "fail", raw, safe, policy.deferred_kv_release)
    lowered = raw.lower()
    if lowered in _ENV_FALSE:
        return CheckOutcome("deferred_kv_release", "fail", raw, safe, policy.deferred_kv_release)
    shown = raw if lowered in _ENV_TRUE else f"{raw!r}: not a boolean to SGLang, so the default (true)"
    return CheckOutcome("deferred_kv_release", "pass", shown, safe, policy.deferred_kv_release)


def _batch_bound(identity: EngineIdentity, policy: CheckPolicy) -> CheckOutcome:
    safe = f"{BATCH_BOUND} > 0 and no custom memory pool other than INTRA_NODE_NVLINK (mooncake)"
    backend = _backend_name(identity)
    if backend not in _BOUNDED_BACKENDS:
        return CheckOutcome("transfer_batch_bound", "unverified", f"{backend or 'unknown backend'}: no batch bound "
                            "to read", safe, policy.transfer_batch_bound)
    env = _env(identity)
    if env is None:
        return CheckOutcome("transfer_batch_bound", "unverified", "environment not exposed", safe,
                            policy.transfer_batch_bound)
    pool = env.get(CUSTOM_MEM_POOL)
    if pool is not None and pool.strip().upper() != "INTRA_NODE_NVLINK":
        return CheckOutcome("transfer_batch_bound", "fail", f"{CUSTOM_MEM_POOL}={pool}: the bound is skipped", safe,
                            policy.transfer_batch_bound)
    raw = env.get(BATCH_BOUND)
    try:
        bound = int(raw) if raw is not None else 0  # int(): as environ.py reads it
    except ValueError:
        return CheckOutcome("transfer_batch_bound", "fail", f"{raw!r} is not an integer", safe,
                            policy.transfer_batch_bound)
    value = "0 (default: one unbounded batch)" if raw is None else str(bound)
    return CheckOutcome("transfer_batch_bound", "pass" if bound > 0 else "fail", value, safe,
                        policy.transfer_batch_bound)


def _release_timeout(identity: EngineIdentity, policy: CheckPolicy) -> CheckOutcome:
    safe = f"{RELEASE_TIMEOUT} finite and ≥ the transfer timeout stated in YAML ({policy.transfer_timeout_s:g} s)"
    modern = release_at_least(identity.version, (0, 5, 22))
    if not modern:
        result: Result = "unverified" if modern is None else "fail"
        return CheckOutcome("release_timeout", result, f"SGLang {identity.version}", safe, policy.release_timeout)
    env = _env(identity)
    if env is None:
        return CheckOutcome("release_timeout", "unverified", "environment not exposed", safe, policy.release_timeout)
    raw = env.get(RELEASE_TIMEOUT)
    try:
        timeout = float(raw) if raw is not None else DEFAULT_RELEASE_TIMEOUT_S
    except ValueError:
        return CheckOutcome("release_timeout", "fail", f"{raw!r} is not a number", safe, policy.release_timeout)
    ok = math.isfinite(timeout) and timeout >= policy.transfer_timeout_s
    value = f"{timeout:g} s" + (" (default)" if raw is None else "")
    return CheckOutcome("release_timeout", "pass" if ok else "fail", value, safe, policy.release_timeout)
