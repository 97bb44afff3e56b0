"""Applying a re-read configuration without a restart (SIGHUP or POST /admin/reload).

A valid file takes effect for new requests: workers it adds pass the KV-pool gate before they get traffic, workers it
drops are drained (their requests in flight finish), and routing, limits, breakers, health checks, timeouts and
prompt limits change for what comes next. What the running process cannot change in place — the listener, the set
of models, a model's tokenizer or chat template, what admission computes (template kwargs, prefix hashing), the
server's own limits — refuses the whole reload with the reason, and the running configuration stays."""

from __future__ import annotations

import asyncio
import logging

from gateway.config import ConfigError, GatewayConfig, ModelConfig, load_config
from gateway.serving.gateway import Gateway
from gateway.serving.models import ServedModel, health_spec, make_policies, model_spec

log = logging.getLogger("kvgate.reload")

# Settings the running process cannot change in place.
_RESTART_KEYS = ("listen", "max_body_bytes", "max_header_bytes", "max_headers", "max_connections",
                 "max_connections_per_client", "max_connections_per_key", "token_cache_bytes", "admission_workers",
                 "discovery", "state")
_MODEL_RESTART_KEYS = ("tokenizer", "chat_template", "chat_template_kwargs")


def restart_needed(old: GatewayConfig, new: GatewayConfig) -> list[str]:
    """Why `new` cannot be applied in place (empty when it can)."""
    problems = [f"{key} changed" for key in _RESTART_KEYS if getattr(old, key) != getattr(new, key)]
    if old.timeouts.client_head_s != new.timeouts.client_head_s:
        problems.append("timeouts.client_head_s changed (the server's header timer)")
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
                            "cache_aware_index_bytes, kv_headroom or a worker's kv_events)")
    return problems


def _cache_routing(model: ModelConfig) -> tuple[object, ...]:
    """What admission computes for cache-aware routing, and what the gateway subscribes to."""
    routing = model.routing
    events = tuple(sorted((url, str(events)) for url, events in model.kv_events_endpoints.items()))
    return (routing.cache_aware_tokens if routing.prefill_policy == "cache_aware" else None,
            routing.needs_prompt_sizes, routing.kv_events, events if routing.prefill_policy == "cache_aware" else (),
            routing.cache_aware_index_bytes if routing.prefill_policy == "cache_aware" else None)


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
    changes = await apply_config(gateway, new)
    log.info("configuration reloaded from %s: %s", gateway.config_path, "; ".join(changes) or "no changes")
    return changes


async def reload_logged(gateway: Gateway) -> None:
    """For SIGHUP: a refused reload is logged, and the running configuration stays."""
    try:
        await reload(gateway)
    except ConfigError as exc:
        log.error("configuration reload refused, running configuration kept: %s", exc)


async def apply_config(gateway: Gateway, new: GatewayConfig) -> list[str]:
    """Apply a configuration that `reload.restart_needed` accepted; returns what changed."""
    changes: list[str] = []
    for name, model in gateway.models.items():
        before, after = model.config, new.model(name)
        assert after is not None
        if after == before and new.health_of(after) == gateway.config.health_of(before):
            continue
        model.config, model.spec = after, model_spec(after)
        prefill_policy, decode_policy = make_policies(after.routing)
        model.pool.reconfigure(limits=model.spec.limits, breaker=model.spec.breaker,
                               prefill_policy=prefill_policy, decode_policy=decode_policy)
        gateway.monitor.update(model.spec, health_spec(new.health_of(after)))
        await gateway.poll_loads(model)
        changes += _apply_workers(gateway, model, before, after)
        await gateway.monitor.verify_now(name)  # the gate again, with the new limits: it updates admission
        changes.append(f"model {name}: settings applied")
    if (new.auth, new.tenants) != (gateway.config.auth, gateway.config.tenants):
        gateway.fleet.reconfigure_tenants(new.auth, new.tenants)  # revoked keys and new limits: next request
        changes.append("tenants and auth applied")
    gateway.config = new
    return changes


def _apply_workers(gateway: Gateway, model: ServedModel, before: ModelConfig, after: ModelConfig) -> list[str]:
    membership = gateway.membership
    old, new = model_spec(before), model.spec
    changes = []
    for spec in [*old.prefill, *old.decode]:
        if spec not in (*new.prefill, *new.decode):
            member = membership.find_url(model.name, spec.role, spec.url)
            if member is not None:
                membership.remove(member)
                changes.append(f"{spec.role} {spec.url} drained and removed")
    for spec in [*new.prefill, *new.decode]:
        if spec not in (*old.prefill, *old.decode):
            existing = membership.find_url(model.name, spec.role, spec.url)
            if existing is not None:  # e.g. its bootstrap port changed: out first
                membership.remove(existing)
            worker = model.pool.new_worker(spec)
            model.pool.add(worker)  # out of rotation until the gate passes it, like any configured worker
            gateway.monitor.watch(model.name, worker)
            changes.append(f"{spec.role} {spec.url} added (in rotation once the gate passes it)")
    return changes
