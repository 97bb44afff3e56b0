"""Applying a re-read configuration without a restart (SIGHUP or POST /admin/reload).

A valid file takes effect for new requests: workers it adds pass the KV-pool gate before they get traffic, workers it
drops are drained (their requests in flight finish), and routing, limits, breakers, health checks, timeouts and
prompt limits change for what comes next. What the running process cannot change in place — the listener, the set
of models, a model's tokenizer or chat template, what admission computes (template kwargs, prefix hashing), the
server's own limits — refuses the whole reload with the reason, and the running configuration stays."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from gateway.config import ConfigError, GatewayConfig, ModelConfig, load_config

if TYPE_CHECKING:
    from gateway.runtime import Gateway

log = logging.getLogger("kvgate.reload")

# Settings the running process cannot change in place.
_RESTART_KEYS = ("listen", "max_body_bytes", "max_header_bytes", "max_headers", "max_connections",
                 "token_cache_bytes", "admission_workers", "discovery", "state")
_MODEL_RESTART_KEYS = ("tokenizer", "chat_template", "chat_template_kwargs")


def restart_needed(old: GatewayConfig, new: GatewayConfig) -> list[str]:
    """Why `new` cannot be applied in place (empty when it can)."""
    problems = [f"{key} changed" for key in _RESTART_KEYS if getattr(old, key) != getattr(new, key)]
    if old.timeouts.client_body_s != new.timeouts.client_body_s:
        problems.append("timeouts.client_body_s changed (the server's header timer)")
    old_names, new_names = [m.name for m in old.models], [m.name for m in new.models]
    if old_names != new_names:
        problems.append(f"the models served changed ({old_names} → {new_names})")
        return problems
    for before in old.models:
        after = new.model(before.name)
        assert after is not None
        problems += [f"models.{before.name}.{key} changed" for key in _MODEL_RESTART_KEYS
                     if getattr(before, key) != getattr(after, key)]
        if any(before.dns_workers(role) != after.dns_workers(role) for role in ("prefill", "decode")):
            problems.append(f"models.{before.name}: dns worker entries changed")
        if _prefix_tokens(before) != _prefix_tokens(after):
            problems.append(f"models.{before.name}: prefix hashing changed (prefix_affinity or prefix_tokens)")
        if _cache_routing(before) != _cache_routing(after):
            problems.append(f"models.{before.name}: cache-aware routing changed (cache_aware, cache_aware_tokens, "
                            "kv_headroom or a worker's kv_events)")
    return problems


def _cache_routing(model: ModelConfig) -> tuple[object, ...]:
    """What admission computes for cache-aware routing, and what the gateway subscribes to."""
    routing = model.routing
    events = tuple(sorted((url, str(events)) for url, events in model.kv_events_endpoints.items()))
    return (routing.cache_aware_tokens if routing.prefill_policy == "cache_aware" else None,
            routing.needs_prompt_sizes, routing.kv_events, events if routing.prefill_policy == "cache_aware" else ())


def _prefix_tokens(model: ModelConfig) -> int | None:
    routing = model.routing
    return routing.prefix_tokens if "prefix_affinity" in (routing.prefill_policy, routing.decode_policy) else None


async def reload(gateway: Gateway) -> list[str]:
    """Re-read the configuration file and apply it; returns what changed. Raises ConfigError (nothing applied)."""
    if gateway.config_path is None:
        raise ConfigError("the gateway was not started from a configuration file")
    new = await asyncio.get_running_loop().run_in_executor(None, load_config, gateway.config_path)
    problems = restart_needed(gateway.config, new)
    if problems:
        raise ConfigError("needs a restart: " + "; ".join(problems))
    changes = await gateway.apply_config(new)
    log.info("configuration reloaded from %s: %s", gateway.config_path, "; ".join(changes) or "no changes")
    return changes


async def reload_logged(gateway: Gateway) -> None:
    """For SIGHUP: a refused reload is logged, and the running configuration stays."""
    try:
        await reload(gateway)
    except ConfigError as exc:
        log.error("configuration reload refused, running configuration kept: %s", exc)
