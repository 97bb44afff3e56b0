"""Every key of config/kvgate.example.yaml works: each is exercised by a test that would fail if the gateway ignored
it. The registry below names that test for every key; the tests further down cover the keys no other module does."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from gateway.admission.chat_template import ChatTemplate
from gateway.admission.tokenizer import ModelTokenizer
from loadtests.engine.harness import EnginePair, start_pair
from tests.engine_records import inject, wait_for
from tests.gateway_harness import ROOT, RunningGateway, model_entry, running_gateway, write_config

# key → "file::test" that fails when the key is ignored.
KEY_TESTS = {
    "listen.host": "tests/gateway/admission/test_admission.py::test_health_and_readiness",
    "listen.port": "tests/gateway/admission/test_admission.py::test_health_and_readiness",
    "timeouts.connect_s": "tests/routing/engines/test_engine_client.py::test_connect_s_bounds_a_connection_that_is_never_accepted",
    "timeouts.prefill_s": "tests/gateway/pd/test_lifecycle_matrix.py::test_timeouts_in_each_phase_end_with_504_and_abort",
    "timeouts.first_token_s": "tests/e2e/test_lifecycle.py::test_decode_that_never_answers_times_out_with_504",
    "timeouts.idle_s": "tests/gateway/pd/test_lifecycle_matrix.py::test_timeouts_in_each_phase_end_with_504_and_abort",
    "timeouts.total_s": "tests/gateway/pd/test_lifecycle_matrix.py::test_total_timeout_fails_a_slow_but_alive_stream",
    "timeouts.abort_s": "tests/routing/engines/test_engine_client.py::test_abort_s_and_telemetry_timeouts_bound_an_engine_that_never_answers",
    "timeouts.client_body_s": "tests/gateway/integrity/test_leak_classes.py::test_a_body_that_never_finishes_is_timed_out_with_408",
    "timeouts.client_head_s": "tests/gateway/integrity/test_leak_classes.py::test_a_connection_that_never_finishes_its_request_head_is_closed_with_408",
    "gate.startup_timeout_s": "tests/routing/test_kv_gate.py::test_unreachable_worker_is_retried_until_the_startup_timeout_then_refused",
    "gate.start_anyway": "tests/routing/test_kv_gate.py::test_refused_model_answers_503_when_configured_to_start_anyway",
    "health.interval_s": "tests/routing/test_kv_gate.py::test_telemetry_is_polled_every_interval_without_traffic",
    "health.timeout_s": "tests/routing/engines/test_engine_client.py::test_abort_s_and_telemetry_timeouts_bound_an_engine_that_never_answers",
    "health.failure_threshold": "tests/routing/test_workers.py::test_health_flips_only_after_the_configured_number_of_reads_in_a_row",
    "health.success_threshold": "tests/routing/test_workers.py::test_health_flips_only_after_the_configured_number_of_reads_in_a_row",
    "max_body_bytes": "tests/gateway/admission/test_admission.py::test_body_over_the_cap_is_refused_before_it_is_read",
    "max_header_bytes": "tests/gateway/admission/test_admission.py::test_header_floods_get_431_before_they_are_buffered",
    "max_headers": "tests/gateway/admission/test_admission.py::test_header_floods_get_431_before_they_are_buffered",
    "max_connections": "tests/gateway/admission/test_admission.py::test_connections_beyond_max_connections_get_503",
    "max_connections_per_client": "tests/e2e/test_fairness.py::test_idle_connections_from_one_address_leave_the_others_served",
    "max_connections_per_key": "tests/e2e/test_fairness.py::test_one_api_key_holds_at_most_its_share_of_connections_from_any_number_of_addresses",
    "token_cache_bytes": "tests/gateway/test_config_keys.py::test_token_cache_bytes_bounds_the_count_cache",
    "admission_workers": "tests/gateway/test_config_keys.py::test_admission_workers_share_large_bodies_by_tenant",
    "models.name": "tests/gateway/admission/test_admission.py::test_models_endpoint_reports_the_effective_limit",
    "models.tokenizer": "tests/gateway/admission/test_admission.py::test_chat_count_equals_the_engines",
    "models.chat_template": "tests/gateway/test_config_keys.py::test_the_configured_chat_template_is_the_one_rendered_and_counted",
    "models.context_length": "tests/gateway/admission/test_admission.py::test_prompt_plus_max_tokens_reaching_context_gets_413",
    "models.max_prompt_tokens": "tests/gateway/admission/test_admission.py::test_chat_prompt_one_over_the_limit_gets_413_and_reaches_no_engine",
    "models.default_max_tokens": "tests/gateway/test_config_keys.py::test_default_and_maximum_output_tokens",
    "models.max_output_tokens": "tests/gateway/test_config_keys.py::test_default_and_maximum_output_tokens",
    "models.on_pool_mismatch": "tests/routing/test_kv_gate.py::test_clamp_moves_the_413_boundary_to_the_smallest_pool",
    "models.min_engine_version": "tests/routing/test_kv_gate.py::test_old_engine_is_warned_by_default_and_refused_when_strict",
    "models.on_old_engine": "tests/routing/test_kv_gate.py::test_old_engine_is_warned_by_default_and_refused_when_strict",
    "models.release": "tests/gateway/test_config_keys.py::test_release_immediate_relays_before_verification_verified_does_not",
    "models.chat_template_kwargs": "tests/gateway/test_config_keys.py::test_chat_template_kwargs_lists_the_keys_a_client_may_send",
    "models.prefill.url": "tests/e2e/test_lifecycle.py::test_client_rid_and_bootstrap_fields_never_reach_an_engine_and_rooms_are_unique",
    "models.prefill.bootstrap_port": "tests/e2e/test_lifecycle.py::test_client_rid_and_bootstrap_fields_never_reach_an_engine_and_rooms_are_unique",
    "models.decode.url": "tests/e2e/test_lifecycle.py::test_client_rid_and_bootstrap_fields_never_reach_an_engine_and_rooms_are_unique",
    "health.path": "tests/e2e/test_routing_live.py::test_a_failing_health_path_takes_the_worker_out_and_a_passing_one_brings_it_back",
    "shutdown.grace_s": "tests/e2e/test_shutdown.py::test_sighup_reloads_then_sigterm_lets_streams_that_fit_the_grace_finish_and_cancels_the_rest_on_both_halves",
    "models.routing.prefill_policy": "tests/e2e/test_routing_live.py::test_session_affinity_by_header",
    "models.routing.decode_policy": "tests/e2e/test_routing_live.py::test_prefix_affinity_keeps_a_shared_prefix_on_one_decode_and_cache_salt_separates",
    "models.routing.affinity_header": "tests/e2e/test_routing_live.py::test_session_affinity_by_header",
    "models.routing.prefix_tokens": "tests/e2e/test_routing_live.py::test_prefix_tokens_sets_how_much_of_the_prompt_keys_affinity",
    "models.routing.load_poll_s": "tests/e2e/test_routing_live.py::test_power_of_two_reads_engine_loads",
    "models.routing.retries": "tests/e2e/test_routing_live.py::test_a_refused_connection_is_retried_on_another_pair_and_a_dead_worker_leaves_rotation",
    "models.routing.cache_aware_tokens": "tests/e2e/test_cache_aware_live.py::test_a_cache_salt_never_routes_by_another_namespaces_pages_and_cache_aware_tokens_bounds_the_match",
    "models.routing.cache_aware_index_bytes": "tests/e2e/test_cache_aware_live.py::test_cache_aware_index_bytes_bounds_each_prefills_views_below_what_its_pool_claims",
    "models.routing.kv_events": "tests/e2e/test_cache_aware_live.py::test_an_eviction_the_engine_reports_shows_at_the_next_pick_and_kv_events_off_does_not_see_it",
    "models.prefill.kv_events.endpoint": "tests/e2e/test_cache_aware_live.py::test_configured_kv_events_endpoints_are_the_ones_subscribed",
    "models.prefill.kv_events.replay_endpoint": "tests/routing/prefix_index/test_kv_events.py::test_a_gap_is_replayed_and_a_malformed_batch_is_counted_and_skipped",
    "models.prefill.kv_events.topic": "tests/routing/prefix_index/test_kv_events.py::test_only_the_configured_topic_is_followed",
    "models.limits.max_inflight_per_worker": "tests/e2e/test_routing_live.py::test_overload_ends_in_503_with_retry_after_never_502_and_workers_stay_in_rotation",
    "models.limits.max_queue": "tests/e2e/test_routing_live.py::test_overload_ends_in_503_with_retry_after_never_502_and_workers_stay_in_rotation",
    "models.limits.queue_timeout_s": "tests/e2e/test_routing_live.py::test_overload_ends_in_503_with_retry_after_never_502_and_workers_stay_in_rotation",
    "models.limits.engine_event_bytes": "tests/e2e/test_engine_reads.py::test_the_caps_are_the_models_own",
    "models.limits.engine_answer_bytes": "tests/e2e/test_engine_reads.py::test_the_caps_are_the_models_own",
    "models.circuit_breaker.failure_threshold": "tests/e2e/test_routing_live.py::test_a_flapping_decode_trips_its_own_breaker_only_and_recovers",
    "models.circuit_breaker.success_threshold": "tests/e2e/test_routing_live.py::test_a_flapping_decode_trips_its_own_breaker_only_and_recovers",
    "models.circuit_breaker.open_s": "tests/e2e/test_routing_live.py::test_a_flapping_decode_trips_its_own_breaker_only_and_recovers",
    "admin.token_env": "tests/routing/test_worker_management.py::test_the_admin_api_needs_its_token_and_every_answer_has_a_request_id",
    "discovery.nameservers": "tests/routing/test_dns_discovery.py::test_dns_workers_join_through_the_gate_and_leave_by_draining",
    "logging.format": "tests/e2e/test_shutdown.py::test_sighup_reloads_then_sigterm_lets_streams_that_fit_the_grace_finish_and_cancels_the_rest_on_both_halves",
    "logging.access_log": "tests/gateway/telemetry/test_metrics.py::test_access_log_false_silences_the_access_log",
    "tracing.enabled": "tests/gateway/telemetry/test_tracing.py::test_spans_are_exported_over_otlp_http",
    "tracing.otlp_endpoint": "tests/gateway/telemetry/test_tracing.py::test_spans_are_exported_over_otlp_http",
    "tracing.service_name": "tests/gateway/telemetry/test_tracing.py::test_spans_are_exported_over_otlp_http",
    "tracing.sample_ratio": "tests/gateway/telemetry/test_tracing.py::test_sample_ratio_zero_starts_no_trace_but_follows_a_sampled_client",
    "models.deployment_checks.version_skew": "tests/routing/test_deployment_checks.py::test_version_skew_is_warned_and_refused_under_refuse",
    "models.deployment_checks.transfer_backend": "tests/routing/test_deployment_checks.py::test_a_fake_transfer_backend_is_refused",
    "models.deployment_checks.role_settings_match": "tests/routing/test_deployment_checks.py::test_a_checksum_mismatch_between_the_roles_is_reported_and_keeps_the_workers_out",
    "models.deployment_checks.deferred_kv_release": "tests/routing/test_deployment_checks.py::test_every_policy_in_the_yaml_reaches_the_gate",
    "models.deployment_checks.transfer_batch_bound": "tests/routing/test_deployment_checks.py::test_every_policy_in_the_yaml_reaches_the_gate",
    "models.deployment_checks.release_timeout": "tests/routing/test_deployment_checks.py::test_every_policy_in_the_yaml_reaches_the_gate",
    "models.deployment_checks.metrics_enabled": "tests/routing/test_deployment_checks.py::test_every_policy_in_the_yaml_reaches_the_gate",
    "models.deployment_checks.engine_chat_rendering": "tests/routing/test_deployment_checks.py::test_engine_chat_rendering_in_the_yaml_reaches_the_gate",
    "models.deployment_checks.require_verified_transfer_settings": "tests/routing/test_deployment_checks.py::test_an_unbounded_mooncake_batch_is_flagged_when_exposed_and_unverified_when_not",
    "models.deployment_checks.require_kv_checksum": "tests/routing/test_deployment_checks.py::test_every_policy_in_the_yaml_reaches_the_gate",
    "models.deployment_checks.transfer_timeout_s": "tests/routing/test_deployment_checks.py::test_every_policy_in_the_yaml_reaches_the_gate",
    "models.integrity.max_prefill_tokens_per_s": "tests/gateway/integrity/test_integrity.py::test_an_implausibly_fast_first_token_is_counted_and_under_strict_nothing_is_released",
    "models.integrity.min_prompt_tokens": "tests/gateway/integrity/test_integrity.py::test_an_implausibly_fast_first_token_is_counted_and_under_strict_nothing_is_released",
    "models.integrity.strict": "tests/gateway/integrity/test_integrity.py::test_an_implausibly_fast_first_token_is_counted_and_under_strict_nothing_is_released",
    "models.integrity.provenance_sample": "tests/gateway/integrity/test_integrity.py::test_a_sampled_answer_carrying_another_tenants_text_is_flagged",
    "models.integrity.provenance_window": "tests/gateway/integrity/test_integrity.py::test_a_sampled_answer_carrying_another_tenants_text_is_flagged",
    "models.integrity.canary_interval_s": "tests/gateway/serving/test_canary.py::test_the_background_prober_runs_on_its_interval_and_finds_no_leak",
    "models.integrity.canary_near_limit": "tests/gateway/serving/test_canary.py::test_the_background_prober_near_the_limit_catches_a_lying_engine",
    "state.backend": "tests/fleet/test_replicas.py::test_a_tenants_token_budget_holds_across_replicas",
    "state.redis_url": "tests/fleet/test_replicas.py::test_a_tenants_token_budget_holds_across_replicas",
    "state.redis_sentinels": "tests/fleet/test_sentinel.py::test_a_sentinel_failover_is_survived_and_state_follows_the_new_primary",
    "state.redis_service": "tests/fleet/test_sentinel.py::test_a_sentinel_failover_is_survived_and_state_follows_the_new_primary",
    "state.on_redis_down": "tests/fleet/test_redis_outage.py::test_stopping_redis_fails_open_or_closed_as_configured_and_both_recover",
    "state.timeout_s": "tests/fleet/test_redis_outage.py::test_stopping_redis_fails_open_or_closed_as_configured_and_both_recover",
    "state.lease_s": "tests/fleet/test_replicas.py::test_a_replica_killed_with_sigkill_leaves_no_phantom_load_once_its_lease_lapses",
    "state.sync_interval_s": "tests/fleet/test_fleet_sync.py::test_other_replicas_load_arrives_on_the_sync_interval",
    "auth.required": "tests/fleet/test_replicas.py::test_requests_need_a_known_api_key",
    "auth.cache_salt_secret_env": "tests/gateway/tenancy/test_tenancy.py::test_the_salt_is_the_keyed_hash_of_the_tenants_group",
    "tenants.name": "tests/fleet/test_replicas.py::test_requests_need_a_known_api_key",
    "tenants.api_keys": "tests/fleet/test_replicas.py::test_requests_need_a_known_api_key",
    "tenants.limits.requests_per_min": "tests/gateway/tenancy/test_tenancy.py::test_a_tenants_request_limit_answers_429_with_retry_after",
    "tenants.limits.body_bytes_per_min": "tests/e2e/test_fairness.py::test_a_bodys_bytes_are_charged_before_it_is_parsed",
    "tenants.limits.prompt_tokens_per_min": "tests/fleet/test_replicas.py::test_a_tenants_token_budget_holds_across_replicas",
    "tenants.limits.output_tokens_per_min": "tests/gateway/tenancy/test_tenancy.py::test_output_tokens_are_charged_and_a_tenant_in_debt_waits",
    "tenants.limits.max_concurrent": "tests/fleet/test_replicas.py::test_a_replica_killed_with_sigkill_leaves_no_phantom_load_once_its_lease_lapses",
    "tenants.cache_group": "tests/gateway/tenancy/test_tenancy.py::test_tenants_get_separate_prefix_caches_and_a_group_shares_one",
    "models.health": "tests/e2e/test_routing_live.py::test_a_killed_decode_leaves_rotation_within_the_health_thresholds_while_prefill_serves_on",
}


def _keys(node: Any, prefix: str = "") -> set[str]:
    if isinstance(node, list):
        return set().union(*(_keys(item, prefix) for item in node)) if node else {prefix.rstrip(".")}
    if not isinstance(node, dict):
        return {prefix.rstrip(".")}
    return set().union(*(_keys(value, f"{prefix}{key}.") for key, value in node.items()))


def test_every_key_of_the_example_config_names_a_test_that_exists() -> None:
    example = yaml.safe_load((ROOT / "config/kvgate.example.yaml").read_text())
    assert _keys(example) == set(KEY_TESTS)
    for key, reference in KEY_TESTS.items():
        path, name = reference.split("::")
        tree = ast.parse((ROOT / path).read_text())
        assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, (key, reference)


# ── the keys no other module covers ───────────────────────────────────────────────────────────────────────────
CUSTOM_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% if shout %} LOUD{% endif %}"
                   "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "custom.jinja"
    path.write_text(CUSTOM_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def pair(template_file: Path) -> Iterator[EnginePair]:
    with start_pair(prefill_pool=20000, decode_pool=20000, context_length=8192, model="glm-5", version="0.5.23",
                    chat_template=str(template_file)) as engines:
        yield engines


@pytest.fixture(scope="module")
def gateway(pair: EnginePair, template_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    def model(name: str, **overrides: Any) -> dict[str, Any]:
        return model_entry(name, [pair.prefill], [pair.decode], chat_template=str(template_file), **overrides)

    config = write_config(tmp_path_factory.mktemp("gw"), [
        model("custom", default_max_tokens=3, max_output_tokens=50),
        model("custom-narrow", chat_template_kwargs=[]),
        model("custom-immediate", release="immediate"),
    ], token_cache_bytes=0, admission_workers=2)
    with running_gateway(config) as running:
        yield running


@pytest.fixture()
def client(gateway: RunningGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        yield http


def _chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello there"}], **extra}


def test_the_configured_chat_template_is_the_one_rendered_and_counted(
        client: httpx.Client, glm_tokenizer: ModelTokenizer, glm_template: ChatTemplate) -> None:
    response = client.post("/v1/chat/completions", json=_chat("custom", max_tokens=2))
    assert response.status_code == 200, response.text
    counted = int(response.headers["x-kvgate-prompt-tokens"])
    assert counted == response.json()["usage"]["prompt_tokens"]
    glm = glm_template.render([{"role": "user", "content": "hello there"}])
    assert counted != len(glm_tokenizer.tokenizer.encode(glm, add_special_tokens=False).ids)


def test_chat_template_kwargs_lists_the_keys_a_client_may_send(client: httpx.Client) -> None:
    loud = client.post("/v1/chat/completions", json=_chat("custom", max_tokens=2, chat_template_kwargs={"shout": True}))
    assert loud.status_code == 200 and int(loud.headers["x-kvgate-prompt-tokens"]) == loud.json()["usage"]["prompt_tokens"]
    narrow = client.post("/v1/chat/completions", json=_chat("custom-narrow", chat_template_kwargs={"shout": True}))
    assert narrow.status_code == 400 and "shout" in narrow.json()["error"]["message"]


def test_default_and_maximum_output_tokens(client: httpx.Client) -> None:
    response = client.post("/v1/chat/completions", json=_chat("custom"))
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
    assert client.post("/v1/chat/completions", json=_chat("custom", max_tokens=51)).status_code == 400
    assert client.post("/v1/chat/completions", json=_chat("custom", max_tokens=50)).status_code == 200


@pytest.mark.parametrize(("model", "released"), [("custom-immediate", True), ("custom", False)])
def test_release_immediate_relays_before_verification_verified_does_not(
        client: httpx.Client, pair: EnginePair, model: str, released: bool) -> None:
    # Decode's first event (the role chunk) carries no count; its first content chunk carries a wrong one.
    inject(pair.decode, action="miscount", offset=2, path="/v1/chat/completions", count=1)
    with client.stream("POST", "/v1/chat/completions", json=_chat(model, max_tokens=8, stream=True)) as response:
        body = response.read()
    if released:
        assert response.status_code == 200 and body.startswith(b"data: {")
        assert b"prompt_token_mismatch" in body and b"[DONE]" not in body
    else:
        assert response.status_code == 502 and orjson.loads(body)["error"]["code"] == "prompt_token_mismatch"


def test_token_cache_bytes_bounds_the_count_cache(client: httpx.Client) -> None:
    for n in range(3):
        client.post("/v1/completions", json={"model": "custom", "prompt": f"{n} " + "words " * 400, "max_tokens": 1})
    assert 'kvgate_token_cache_bytes{model="custom"} 0.0' in client.get("/metrics").text


def test_admission_workers_share_large_bodies_by_tenant(client: httpx.Client, gateway: RunningGateway) -> None:
    large = {"model": "custom", "prompt": " " * 100_000, "max_tokens": 1}  # > 64 KiB, few tokens
    for key in ("tenant-a", "tenant-b", "tenant-c", "tenant-d"):
        response = client.post("/v1/completions", json=large, headers={"authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text
    workers = gateway.gateway.admission_workers
    assert workers is not None and wait_for(lambda: sum(e is not None for e in workers._executors) == 2)
