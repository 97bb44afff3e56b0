"""The incident's deployment gate beyond the pool: transfer-safety settings and version skew, per worker, from what
`/server_info` reveals (SGLang 0.5.8 / 0.5.22 / 0.5.23; the sources are cited in README's checklist).

Each check is pass, fail or unverified (the engine does not reveal the value: an older version, or environment
variables not exposed with SGLANG_EXPOSE_OWN_ENV_VARS=1, where a variable that is absent is at its default). A
failure counts under the check's policy — `refuse` keeps the worker out of rotation, `warn` only reports — and an
unverified check fails only when the model requires verified transfer settings. Pure functions, no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from routing.engines.identity import EngineIdentity, version_tuple

Result = Literal["pass", "fail", "unverified"]
Policy = Literal["warn", "refuse"]

REAL_BACKENDS = frozenset({"mooncake", "nixl", "mori", "ascend"})
DEFERRED_RELEASE = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
RELEASE_TIMEOUT = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"
BATCH_BOUND = "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES"
CUSTOM_MEM_POOL = "SGLANG_MOONCAKE_CUSTOM_MEM_POOL"
DEFAULT_RELEASE_TIMEOUT_S = 30.0  # environ.py, 0.5.22 and 0.5.23
_FALSE = frozenset({"0", "false", "no", "off", ""})


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
    require_verified_transfer_settings: bool = False
    transfer_timeout_s: float = 30.0  # the operator's worst-case KV transfer (Mooncake's MC_TRANSFER_TIMEOUT: 30 s)


@dataclass(frozen=True, slots=True)
class CheckOutcome:
    check: str
    result: Result
    value: str  # what the engine reported (or why it could not be read)
    safe: str   # what would pass
    policy: Policy

    @property
    def counts_against(self) -> bool:
        return self.result == "fail"

    def text(self) -> str:
        return f"{self.check}: {self.result} ({self.value}; safe: {self.safe})"


def check_worker(role: str, identity: EngineIdentity, others: Sequence[EngineIdentity],
                 policy: CheckPolicy) -> list[CheckOutcome]:
    """Every check for one worker; `others` are the identities of the model's workers of the other role."""
    settings = identity.settings
    checks = [
        _version_skew(identity, others, policy),
        _backend(identity, others, policy),
        _matching("kv_checksum_match", settings.kv_checksum, [o.settings.kv_checksum for o in others], policy),
        _matching("decode_allocation_policy_match", settings.decode_allocation_policy,
                  [o.settings.decode_allocation_policy for o in others], policy),
        _deferred_release(identity, policy),
    ]
    if role == "prefill":
        checks.append(_batch_bound(identity, policy))
    else:
        checks.append(_release_timeout(identity, policy))
    metrics = settings.metrics_enabled
    checks.append(CheckOutcome("metrics_enabled", "unverified" if metrics is None else "pass" if metrics else "fail",
                               "not reported" if metrics is None else str(metrics).lower(), "true (--enable-metrics)",
                               policy.metrics_enabled))
    return checks


def _version_skew(identity: EngineIdentity, others: Sequence[EngineIdentity], policy: CheckPolicy) -> CheckOutcome:
    versions = sorted({o.version for o in others})
    safe = "the same version on prefill and decode"
    if not versions:
        return CheckOutcome("version_skew", "unverified", f"{identity.version}; no other role read", safe,
                            policy.version_skew)
    skewed = [v for v in versions if v != identity.version]
    value = identity.version + (f" vs {', '.join(skewed)} on the other role" if skewed else "")
    return CheckOutcome("version_skew", "fail" if skewed else "pass", value, safe, policy.version_skew)


def _backend(identity: EngineIdentity, others: Sequence[EngineIdentity], policy: CheckPolicy) -> CheckOutcome:
    backend = identity.settings.backend
    safe = f"one of {', '.join(sorted(REAL_BACKENDS))}, the same on both roles"
    if backend is None:
        return CheckOutcome("transfer_backend", "unverified", "not reported", safe, policy.transfer_backend)
    other = sorted({o.settings.backend for o in others if o.settings.backend is not None and
                    o.settings.backend != backend})
    ok = backend in REAL_BACKENDS and not other
    value = backend + (f" vs {', '.join(other)} on the other role" if other else "")
    return CheckOutcome("transfer_backend", "pass" if ok else "fail", value, safe, policy.transfer_backend)


def _matching(name: str, value: object, others: Sequence[object], policy: CheckPolicy) -> CheckOutcome:
    safe = "the same on prefill and decode"
    if value is None:
        return CheckOutcome(name, "unverified", "not reported (SGLang < 0.5.22)", safe, policy.role_settings_match)
    different = sorted({str(o) for o in others if o is not None and o != value})
    shown = str(value).lower() if isinstance(value, bool) else str(value)
    if different:
        return CheckOutcome(name, "fail", f"{shown} vs {', '.join(different).lower()} on the other role", safe,
                            policy.role_settings_match)
    return CheckOutcome(name, "pass", shown, safe, policy.role_settings_match)


def _env(identity: EngineIdentity) -> dict[str, str] | None:
    exposed = identity.settings.env_vars
    return dict(exposed) if exposed is not None else None


def _modern(identity: EngineIdentity) -> bool:
    return version_tuple(identity.version) >= (0, 5, 22)


def _deferred_release(identity: EngineIdentity, policy: CheckPolicy) -> CheckOutcome:
    safe = f"{DEFERRED_RELEASE} not false (default true since 0.5.22)"
    if not _modern(identity):
        return CheckOutcome("deferred_kv_release", "fail", f"absent in SGLang {identity.version}", safe,
                            policy.deferred_kv_release)
    env = _env(identity)
    if env is None:
        return CheckOutcome("deferred_kv_release", "unverified", "environment not exposed", safe,
                            policy.deferred_kv_release)
    value = env.get(DEFERRED_RELEASE)
    if value is None:
        return CheckOutcome("deferred_kv_release", "pass", "true (default)", safe, policy.deferred_kv_release)
    ok = value.strip().lower() not in _FALSE
    return CheckOutcome("deferred_kv_release", "pass" if ok else "fail", value, safe, policy.deferred_kv_release)


def _batch_bound(identity: EngineIdentity, policy: CheckPolicy) -> CheckOutcome:
    safe = f"{BATCH_BOUND} > 0 and {CUSTOM_MEM_POOL} unset (mooncake)"
    if identity.settings.backend not in (None, "mooncake"):
        return CheckOutcome("transfer_batch_bound", "pass", f"not applicable to {identity.settings.backend}", safe,
                            policy.transfer_batch_bound)
    env = _env(identity)
    if env is None:
        return CheckOutcome("transfer_batch_bound", "unverified", "environment not exposed", safe,
                            policy.transfer_batch_bound)
    if CUSTOM_MEM_POOL in env:
        return CheckOutcome("transfer_batch_bound", "fail", f"{CUSTOM_MEM_POOL} set: the bound is skipped", safe,
                            policy.transfer_batch_bound)
    raw = env.get(BATCH_BOUND)
    try:
        bound = int(raw) if raw is not None else 0
    except ValueError:
        return CheckOutcome("transfer_batch_bound", "fail", f"{raw!r} is not a number", safe,
                            policy.transfer_batch_bound)
    value = "0 (default: one unbounded batch)" if raw is None else str(bound)
    return CheckOutcome("transfer_batch_bound", "pass" if bound > 0 else "fail", value, safe,
                        policy.transfer_batch_bound)


def _release_timeout(identity: EngineIdentity, policy: CheckPolicy) -> CheckOutcome:
    safe = f"{RELEASE_TIMEOUT} ≥ the transfer timeout stated in YAML ({policy.transfer_timeout_s:g} s)"
    if not _modern(identity):
        return CheckOutcome("release_timeout", "fail", f"absent in SGLang {identity.version}", safe,
                            policy.release_timeout)
    env = _env(identity)
    if env is None:
        return CheckOutcome("release_timeout", "unverified", "environment not exposed", safe, policy.release_timeout)
    raw = env.get(RELEASE_TIMEOUT)
    try:
        timeout = float(raw) if raw is not None else DEFAULT_RELEASE_TIMEOUT_S
    except ValueError:
        return CheckOutcome("release_timeout", "fail", f"{raw!r} is not a number", safe, policy.release_timeout)
    value = f"{timeout:g} s" + (" (default)" if raw is None else "")
    return CheckOutcome("release_timeout", "pass" if timeout >= policy.transfer_timeout_s else "fail", value, safe,
                        policy.release_timeout)
