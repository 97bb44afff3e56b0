"""Non-generation SGLang endpoints: health, server/model info, models, load, metrics, flush_cache, abort_request."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Any

import orjson

from .config import EngineConfig
from .dialect import Dialect
from .engine import Engine
from .httpcore import TEXT, Request
from .metrics import Metrics

_FLUSH_MSG = (b"Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
              b"requests, the operation will not be performed.)\n")


# `disaggregation_transfer_backend` as ServerArgs.resolved_dict() reports it (0.5.22+)
_RESOLVED_BACKEND = {"mooncake_tcp": "mooncake"}


def server_args(cfg: EngineConfig, tokenizer_path: str) -> dict[str, Any]:
    """The ServerArgs fields a gateway may read (server_info flattens them at the top level). 0.5.8 reports the
    backend as given and has no checksum or allocation-policy field."""
    modern = cfg.dialect is not Dialect.V0_5_8
    backend = _RESOLVED_BACKEND.get(cfg.transfer_backend, cfg.transfer_backend) if modern else cfg.transfer_backend
    extra: dict[str, Any] = {"disaggregation_enable_kv_checksum": cfg.enable_kv_checksum,
                             "disaggregation_decode_allocation_policy": cfg.decode_allocation_policy,
                             "default_chat_template_kwargs": cfg.default_chat_template_kwargs} if modern else {}
    return {**extra,
        "model_path": cfg.model, "tokenizer_path": tokenizer_path, "served_model_name": cfg.model,
        "host": cfg.host, "port": cfg.port, "context_length": cfg.context_length, "page_size": cfg.page_size,
        "max_total_tokens": cfg.pool_tokens, "max_running_requests": None, "max_queued_requests": None,
        "chunked_prefill_size": None, "max_prefill_tokens": 16384, "mem_fraction_static": None,
        "allow_auto_truncate": False, "tp_size": 1, "dp_size": 1 + len(cfg.dp_rank_pool_tokens), "pp_size": 1,
        "load_balance_method": "round_robin",
        "disaggregation_mode": cfg.role, "disaggregation_bootstrap_port": cfg.bootstrap_port,
        "disaggregation_transfer_backend": backend, "disaggregation_decode_tp": None,
        "disaggregation_decode_dp": None, "disaggregation_ib_device": None,
        "num_reserved_decode_tokens": cfg.num_reserved_decode_tokens,
        "enable_metrics": cfg.enable_metrics, "skip_tokenizer_init": False, "stream_output": False,
        "chat_template": cfg.chat_template, "completion_template": None,
        "kv_events_config": cfg.kv_events_config, "enable_cache_report": cfg.enable_cache_report,
        "disable_radix_cache": False, "schedule_policy": "fcfs",
    }


def kv_events_descriptor(cfg: EngineConfig) -> dict[str, Any] | None:
    """0.5.22+ `describe_kv_events_publisher`: where a router subscribes (`kv_events` in /server_info); None unless
    a zmq publisher has a tcp endpoint."""
    events = cfg.kv_events
    if events is None or events.publisher == "null" or not events.endpoint or cfg.page_size <= 0:
        return None

    def host_port(endpoint: str | None) -> tuple[str, int] | None:
        if not endpoint or not endpoint.startswith("tcp://"):
            return None
        host, sep, port = endpoint[len("tcp://"):].rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            return None
        return host, int(port)

    pub = host_port(events.endpoint)
    if pub is None:
        return None
    descriptor: dict[str, Any] = {"publisher": events.publisher, "endpoint_host": pub[0], "endpoint_port_base": pub[1],
                                  "topic": events.topic, "block_size": cfg.page_size, "dp_size": 1}
    replay = host_port(events.replay_endpoint)
    if replay is not None:
        descriptor["replay_endpoint_port_base"] = replay[1]
    return descriptor


class InfoAPI:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cfg = engine.cfg

    async def health(self, req: Request) -> None:
        """A real 1-token FAKE-backend run through the pool, answered after `health_delay_s` (SGLang polls 1 s)."""
        fault = self.engine.faults.take("health", req.path)
        if fault is not None:
            if fault.delay_ms:
                await asyncio.sleep(fault.delay_ms / 1000)
            req.respond(fault.status, b"", TEXT)
            return
        pool = self.engine.pool
        pages = await pool.alloc(1)
        try:
            if self.cfg.health_delay_s > 0:
                await asyncio.sleep(self.cfg.health_delay_s)
        finally:
            pool.free(pages, 1)
        req.respond(200, b"", TEXT)

    def _internal_state(self, pool_tokens: int) -> dict[str, Any]:
        cfg = self.cfg
        state = {**server_args(cfg, self.engine.tok.path), "last_gen_throughput": self.engine.gen_throughput(),
                 "memory_usage": {"weight": 0.0, "kvcache": 0.0, "token_capacity": pool_tokens, "graph": 0.0},
                 "effective_max_running_requests_per_dp": 4096, "disaggregation_mode": cfg.role}
        if cfg.expose_env_vars and cfg.dialect is not Dialect.V0_5_8:
            # exportable_env_vars(): only the Envs fields present in the environment, never MC_* (Mooncake's own)
            state["env_vars"] = {name: value for name, value in cfg.env if name.startswith("SGLANG_")}
        return state

    async def server_info(self, req: Request) -> None:
        cfg = self.cfg
        body = {**server_args(cfg, self.engine.tok.path), "status": "ready",
                "max_total_num_tokens": cfg.reported_pool_tokens, "max_req_input_len": cfg.reported_max_req_input_len,
                # a lying engine lies on every rank's report (its rank 0 is the pool it claims)
                "internal_states": [self._internal_state(pool) for pool in (cfg.reported_pool_tokens,
                                                                            *cfg.dp_rank_pool_tokens)],
                "version": cfg.version}
        if cfg.dialect is not Dialect.V0_5_8:
            body["kv_events"] = kv_events_descriptor(cfg)  # build_server_info
        req.respond(200, orjson.dumps(body))

    async def model_info(self, req: Request) -> None:
        req.respond(200, orjson.dumps({
            "model_path": self.cfg.model, "tokenizer_path": self.engine.tok.path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default", "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": "glm_moe", "architectures": ["EmulatedForCausalLM"]}))

    async def models(self, req: Request) -> None:
        req.respond(200, orjson.dumps({"object": "list", "data": [{
            "id": self.cfg.model, "object": "model", "created": int(self.engine.started), "owned_by": "sglang",
            "root": self.cfg.model, "parent": None, "max_model_len": self.cfg.context_length}]}))

    def _counts(self) -> tuple[int, int, int, dict[str, int]]:
        q = self.engine.queue_counts()
        waiting = q["bootstrap"] + q["waiting"] + q["prealloc"] + q["transfer"]
        running = len(self.engine.inflight) - waiting
        num_tokens = self.engine.pool.used_tokens + self.engine.waiting_tokens()
        return running, waiting, num_tokens, q

    async def get_load(self, req: Request) -> None:
        running, waiting, num_tokens, _ = self._counts()
        req.respond(200, orjson.dumps([{"rid": None, "http_worker_ipc": None, "dp_rank": 0,
                                        "num_reqs": running + waiting, "num_waiting_reqs": waiting,
                                        "num_tokens": num_tokens, "ts_tic": time.time()}]))

    async def loads(self, req: Request) -> None:
        if self.cfg.dialect is Dialect.V0_5_8:
            self._loads_058(req)
        else:
            self._loads_0522(req)

    def _loads_058(self, req: Request) -> None:
        """0.5.8 `get_loads` (GetLoadsReqOutput, None sections and the timestamp dropped) and its envelope."""
        cfg, pool = self.cfg, self.engine.pool
        running, waiting, _, q = self._counts()
        usage = pool.used_tokens / cfg.max_total_num_tokens
        throughput = self.engine.gen_throughput()
        load: dict[str, Any] = {
            "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
            "num_used_tokens": pool.used_tokens, "max_total_num_tokens": cfg.max_total_num_tokens,
            "token_usage": round(usage, 4), "gen_throughput": round(throughput, 2),
            "cache_hit_rate": round(self.engine.prefill_stats.cache_hit_rate, 4), "utilization": round(usage, 4),
            "max_running_requests": 4096,
            "memory": {"weight_gb": 0.0, "kv_cache_gb": 0.0, "graph_gb": 0.0,
                       "token_capacity": cfg.max_total_num_tokens},
            "disaggregation": {"mode": cfg.role, "prefill_prealloc_queue_reqs": q["bootstrap"],
                               "prefill_inflight_queue_reqs": q["inflight"],
                               "decode_prealloc_queue_reqs": q["prealloc"],
                               "decode_transfer_queue_reqs": q["transfer"], "decode_retracted_queue_reqs": 0,
                               "kv_transfer_speed_gb_s": 0.0, "kv_transfer_latency_ms": 0.0},
            "queues": {"waiting": q["waiting"], "grammar": 0, "paused": 0, "retracted": 0},
        }
        if req.query.get("format") == "prometheus":
            lines = [f"sglang_{k}{{dp_rank=\"0\"}} {v}" for k, v in load.items()
                     if isinstance(v, (int, float)) and k != "dp_rank"]
            req.respond(200, ("\n".join(lines) + "\n").encode(), TEXT)
            return
        load["num_total_reqs"] = running + waiting
        req.respond(200, orjson.dumps({
            "timestamp": datetime.now(UTC).isoformat(), "version": cfg.version, "dp_rank_count": 1,
            "loads": [load],
            "aggregate": {"total_running_reqs": running, "total_waiting_reqs": waiting,
                          "total_reqs": running + waiting, "avg_token_usage": round(usage, 4),
                          "avg_throughput": round(throughput, 2), "avg_utilization": round(usage, 4)}}))

    def _loads_0522(self, req: Request) -> None:
        """0.5.22+ `SchedulerLoadInquirer.get_loads` (LoadSnapshot.to_dict: every core field, then the sections)
        and its envelope (no aggregate; accelerator metadata)."""
        eng, cfg, pool = self.engine, self.cfg, self.engine.pool
        running, waiting, _, q = self._counts()
        kv = {g: len(g.kv_ids) for g in eng.inflight.values()}
        pending = sum(n for g, n in kv.items() if g.queue in ("bootstrap", "waiting", "prealloc"))
        awaiting_kv = sum(n for g, n in kv.items() if g.queue in ("prealloc", "transfer"))
        ready = [n for g, n in kv.items() if g.queue == "prealloc"]  # handshake done, waiting for KV room
        usage = pool.used_tokens / cfg.max_total_num_tokens
        stats = eng.prefill_stats
        total = pool.used_tokens + pending
        load: dict[str, Any] = {
            "timestamp": time.time(), "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
            "num_waiting_uncached_tokens": eng.waiting_uncached_tokens() if cfg.role == "prefill" else 0,
            "num_used_tokens": pool.used_tokens, "num_total_tokens": total,
            "num_active_tokens": max(0, total - awaiting_kv), "num_prealloc_ready_tokens": sum(ready),
            "max_total_num_tokens": cfg.max_total_num_tokens, "max_running_requests": 4096,
            "token_usage": round(usage, 4), "gen_throughput": round(eng.gen_throughput(), 2),
            "cache_hit_rate": round(stats.cache_hit_rate, 4), "utilization": round(usage, 4),
            "total_prefill_uncached_tokens": stats.uncached_tokens, "total_prefill_busy_us": stats.busy_us,
            "decode_moments": None,
            "memory": {"weight_gb": 0.0, "kv_cache_gb": 0.0, "graph_gb": 0.0,
                       "token_capacity": cfg.max_total_num_tokens},
            "disaggregation": {"mode": cfg.role, "prefill_bootstrap_queue_reqs": q["bootstrap"],
                               "prefill_inflight_queue_reqs": q["inflight"],
                               "decode_prealloc_queue_reqs": q["prealloc"],
                               "decode_transfer_queue_reqs": q["transfer"], "decode_retracted_queue_reqs": 0,
                               "kv_transfer_speed_gb_s": 0.0, "kv_transfer_latency_ms": 0.0},
            "queues": {"waiting": q["waiting"], "grammar": 0, "paused": 0, "retracted": 0,
                       "prealloc_ready": len(ready)},
        }
        if req.query.get("format") == "prometheus":
            lines: list[str] = []
            prefixes = {"disaggregation": "disagg"}
            for key, value in load.items():
                if key == "dp_rank":
                    continue
                items = ([(f"sglang_{prefixes.get(key, key)}_{k}", v) for k, v in value.items()]
                         if isinstance(value, dict) else [(f"sglang_{key}", value)])
                for name, v in items:
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        lines += [f"# TYPE {name} gauge", f'{name}{{dp_rank="0"}} {v}']
            req.respond(200, ("\n".join(lines) + "\n").encode(), b"text/plain; version=0.0.4; charset=utf-8")
            return
        req.respond(200, orjson.dumps({
            "timestamp": datetime.now(UTC).isoformat(), "version": cfg.version, "accelerator": None,
            "num_accelerators": 1, "loads": [load]}))

    async def metrics(self, req: Request) -> None:
        req.respond(200, self.engine.metrics.render(self._refresh), b"text/plain; version=0.0.4; charset=utf-8")

    def _refresh(self, m: Metrics) -> None:
        cfg, pool = self.cfg, self.engine.pool
        running, _waiting, _, q = self._counts()
        m.num_running_reqs.set(running)
        m.num_queue_reqs.set(q["waiting"])  # the prefill's waiting queue (PD decodes queue in prealloc/transfer)
        m.num_used_tokens.set(pool.used_tokens)
        m.token_usage.set(pool.used_tokens / cfg.max_total_num_tokens)
        m.max_total_num_tokens.set(cfg.max_total_num_tokens)
        m.cache_hit_rate.set(self.engine.prefill_stats.cache_hit_rate)
        m.gen_throughput.set(self.engine.gen_throughput())
        m.prefill_prealloc.set(q["bootstrap"])
        m.prefill_inflight.set(q["inflight"])
        m.decode_prealloc.set(q["prealloc"])
        m.decode_transfer.set(q["transfer"])

    async def flush_cache(self, req: Request) -> None:
        """`flush_cache`: refused while requests run or wait; otherwise the radix cache resets, which publishes
        AllBlocksCleared."""
        if self.engine.inflight:
            req.respond(400, _FLUSH_MSG, TEXT)
            return
        self.engine.prefix_cache.flush()
        self.engine.publish_kv_events()
        req.respond(200, _FLUSH_MSG, TEXT)

    async def abort_request(self, req: Request) -> None:
        """Prefix match on rid, as `Scheduler.abort_request` does; unknown rids are a silent no-op."""
        try:
            body = orjson.loads(req.body or b"{}")
            rid = body.get("rid") or ""
            abort_all = bool(body.get("abort_all", False))
            if not isinstance(rid, str):
                raise ValueError("rid must be a string")
        except (ValueError, AttributeError) as e:
            req.respond(400, orjson.dumps({"error": {"message": str(e)}}))
            return
        if rid or abort_all:
            self.engine.abort_prefix(rid, abort_all)
        req.respond(200, b"", TEXT)
