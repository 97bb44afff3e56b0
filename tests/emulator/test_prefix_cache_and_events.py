"""The emulator's radix prefix cache, its KV events on a real ZMQ SUB socket, the prefill timeline and the decode's
preallocation queue, for cache-aware routing (issue 21, item 6).

Block hashes are recomputed here from SGLang's formula (SHA-256 chained over each page's tokens as 4-byte
little-endian unsigned ints, the first 8 bytes as a signed int64); payloads are decoded with msgspec's generic
msgpack decoder, so the test shares no code with the emulator's wire structs.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from loadtests.engine.harness import RunningEngine, free_port
from tests.emulator.helpers import FAKE, post, post_pd, start_engines, stop_all

END = (-1).to_bytes(8, "big", signed=True)
CACHE_TOKENS = 200
RATE = 2000  # prefill tokens per second of the timed prefill
_ids = itertools.count(1000, 500)


def fresh(n: int) -> list[int]:
    """n token ids no other test uses."""
    start = next(_ids)
    return list(range(start, start + n))


def page_hashes(tokens: list[int], page_size: int) -> list[int]:
    out: list[int] = []
    prior = b""
    for start in range(0, len(tokens) - len(tokens) % page_size, page_size):
        h = hashlib.sha256(prior)
        for t in tokens[start:start + page_size]:
            h.update(t.to_bytes(4, "little", signed=False))
        prior = h.digest()
        out.append(int.from_bytes(prior[:8], "big", signed=True))
    return out


class Events:
    """A SUB socket on one engine's publisher (and a DEALER for its replay ROUTER)."""

    def __init__(self, ctx: zmq.Context, engine: RunningEngine, pub: int, replay: int, topic: bytes,
                 modern: bool) -> None:
        self.engine, self.ctx, self.replay_port, self.topic, self.modern = engine, ctx, replay, topic, modern
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(f"tcp://127.0.0.1:{pub}")
        for _ in range(50):  # slow joiner: flush until an AllBlocksCleared arrives
            assert httpx.post(engine.url + "/flush_cache").status_code == 200
            if self.sub.poll(200):
                break
        else:
            raise AssertionError("the subscription never got an event")
        self.drain()

    def drain(self) -> None:
        while self.sub.poll(150):
            self.sub.recv_multipart()

    def recv(self, timeout_s: float = 5.0) -> tuple[int, bytes]:
        assert self.sub.poll(int(timeout_s * 1000)), "no event batch"
        topic, seq, payload = self.sub.recv_multipart()
        assert topic == self.topic and len(seq) == 8
        return int.from_bytes(seq, "big"), payload

    def quiet(self, wait_s: float = 0.4) -> bool:
        return not self.sub.poll(int(wait_s * 1000))

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        """(seq, payload) of every batch the replay ROUTER sends from `start`, checking each frame's shape."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{self.replay_port}")
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[tuple[int, bytes]] = []
        try:
            while True:
                assert dealer.poll(5000), "replay did not answer"
                frames = dealer.recv_multipart()
                if self.modern:  # 0.5.22+: the topic too, as live events carry it
                    empty, topic, seq, payload = frames
                    if seq == END:
                        assert (topic, payload) == (b"", b"")
                        return out
                    assert topic == self.topic
                else:
                    empty, seq, payload = frames
                    if seq == END:
                        assert payload == b""
                        return out
                assert empty == b""
                out.append((int.from_bytes(seq, "big"), payload))
        finally:
            dealer.close(0)

    def flush(self) -> tuple[int, list[Any]]:
        assert httpx.post(self.engine.url + "/flush_cache").status_code == 200
        seq, payload = self.recv()
        return seq, batch_events(payload)


def batch_events(payload: bytes) -> list[Any]:
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert isinstance(ts, float) and abs(ts - time.time()) < 60 and rank == 0
    return events


def stored_hashes(events: list[Any]) -> list[int]:
    """The hashes a batch stores (an eviction's BlockRemoved may lead it), in either shape."""
    out: list[int] = []
    for e in events:
        if isinstance(e, list) and e[0] == "BlockStored":
            out += e[1]
        elif isinstance(e, dict) and e["type"] == "BlockStored":
            out += e["block_hashes"]
    return out


def generate(engine: RunningEngine, ids: list[int], **extra: Any) -> dict[str, Any]:
    status, body = post(engine, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}, **extra})
    assert status == 200, body
    return body["meta_info"]


def cache_stats(engine: RunningEngine) -> dict[str, int]:
    return httpx.get(engine.url + "/emu/cache").json()


def hooks(engine: RunningEngine, **body: Any) -> None:
    r = httpx.post(engine.url + "/emu/kv_events", json=body)
    assert r.status_code == 200, r.text


# engines: two publishing prefills (0.5.8, page 1; 0.5.23, page 4) with a small cache, and a timed pair

@pytest.fixture(scope="module")
def ports() -> dict[str, int]:
    return {name: free_port() for name in ("pub58", "rep58", "pub523", "rep523")}


@pytest.fixture(scope="module")
def engines(ports: dict[str, int]) -> Iterator[dict[str, RunningEngine]]:
    def events(pub: int, rep: int, topic: str) -> dict[str, Any]:
        return {"publisher": "zmq", "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{rep}",
                "topic": topic, "buffer_steps": 10000}

    specs = [
        ("prefill", {"version": "0.5.8", "page_size": 1, "cache_tokens": CACHE_TOKENS, "enable_cache_report": True,
                     "kv_events_config": events(ports["pub58"], ports["rep58"], "")}),
        ("prefill", {"version": "0.5.23", "page_size": 4, "cache_tokens": CACHE_TOKENS, "enable_cache_report": True,
                     "kv_events_config": events(ports["pub523"], ports["rep523"], "kv@eng")}),
        ("prefill", {"version": "0.5.23", "prefill_tokens_per_s": RATE}),
        ("decode", {"version": "0.5.23", "pool_tokens": 2048, "context_length": 4096, "token_delay_ms": 1,
                    "num_reserved_decode_tokens": 512}),
    ]
    started = start_engines(specs)
    try:
        yield dict(zip(("v058", "v0523", "prefill", "decode"), started))
    finally:
        stop_all(started)


@pytest.fixture(scope="module")
def zctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def ev58(engines: dict[str, RunningEngine], ports: dict[str, int], zctx: zmq.Context) -> Events:
    return Events(zctx, engines["v058"], ports["pub58"], ports["rep58"], b"", modern=False)


@pytest.fixture(scope="module")
def ev523(engines: dict[str, RunningEngine], ports: dict[str, int], zctx: zmq.Context) -> Events:
    return Events(zctx, engines["v0523"], ports["pub523"], ports["rep523"], b"kv@eng", modern=True)


# cached_tokens

@pytest.mark.parametrize(("name", "page"), [("v058", 1), ("v0523", 4)])
def test_repeated_and_extended_prompts_report_their_cached_prefix(engines: dict[str, RunningEngine], name: str,
                                                                  page: int) -> None:
    eng = engines[name]
    prompt = fresh(42)
    assert generate(eng, prompt)["cached_tokens"] == 0
    assert generate(eng, prompt)["cached_tokens"] == (42 - 1) // page * page  # never the last token
    assert generate(eng, prompt + fresh(9))["cached_tokens"] == 42 // page * page  # the whole pages it stored
    assert generate(eng, prompt[:20] + fresh(30))["cached_tokens"] == 20 // page * page


@pytest.mark.parametrize("name", ["v058", "v0523"])
def test_openai_usage_reports_cached_tokens_with_cache_report(engines: dict[str, RunningEngine], name: str) -> None:
    eng = engines[name]
    prompt = fresh(30)
    body = {"model": "m", "prompt": prompt, "max_tokens": 1}
    first = post(eng, "/v1/completions", body)[1]["usage"]["prompt_tokens_details"]
    second = post(eng, "/v1/completions", body)[1]["usage"]["prompt_tokens_details"]
    cached = generate(eng, prompt)["cached_tokens"]
    # 0.5.8 reports the details only when something was cached; 0.5.22+ always
    assert first == (None if name == "v058" else {"cached_tokens": 0})
    assert second == {"cached_tokens": cached} and cached > 0
    r = httpx.post(eng.url + "/v1/completions", timeout=30, json={
        **body, **FAKE, "stream": True, "stream_options": {"include_usage": True}})
    final = msgspec.json.decode(r.content.split(b"\n\n")[-3][len(b"data: "):])
    assert final["choices"] == [] and final["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}


def test_namespaces_are_isolated(engines: dict[str, RunningEngine]) -> None:
    eng = engines["v058"]
    prompt = fresh(25)
    assert generate(eng, prompt, extra_key="tenant-a")["cached_tokens"] == 0
    assert generate(eng, prompt, extra_key="tenant-a")["cached_tokens"] == 24
    assert generate(eng, prompt, extra_key="tenant-b")["cached_tokens"] == 0
    assert generate(eng, prompt)["cached_tokens"] == 0
    assert generate(eng, prompt, extra_key="tenant-b")["cached_tokens"] == 24


# event shapes and hashes

def test_0_5_8_events_are_tagged_arrays_one_per_page(ev58: Events) -> None:
    ev58.flush()
    prompt = fresh(5)
    generate(ev58.engine, prompt, extra_key="ns-1")
    _, payload = ev58.recv()
    hashes = page_hashes(prompt, 1)
    assert batch_events(payload) == [["BlockStored", [h], parent, [t], 1, None]
                                     for h, parent, t in zip(hashes, [None, *hashes[:-1]], prompt)]
    # an extension chains from the stored prefix; another namespace stores the same hashes (namespace-blind)
    longer = prompt + fresh(2)
    generate(ev58.engine, longer, extra_key="ns-1")
    ext = page_hashes(longer, 1)
    assert batch_events(ev58.recv()[1]) == [["BlockStored", [ext[5]], ext[4], [longer[5]], 1, None],
                                            ["BlockStored", [ext[6]], ext[5], [longer[6]], 1, None]]
    generate(ev58.engine, prompt, extra_key="ns-2")
    assert stored_hashes(batch_events(ev58.recv()[1])) == hashes
    assert ev58.flush()[1] == [["AllBlocksCleared"]]
    assert cache_stats(ev58.engine)["tokens"] == 0


def test_0_5_23_events_are_tagged_maps_one_per_node(ev523: Events) -> None:
    ev523.flush()
    prompt = fresh(10)  # two whole pages of 4; the tail is not cached
    generate(ev523.engine, prompt)
    hashes = page_hashes(prompt, 4)
    assert len(hashes) == 2
    assert batch_events(ev523.recv()[1]) == [{
        "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": prompt[:8],
        "block_size": 4, "lora_id": None, "medium": "GPU"}]
    longer = prompt + fresh(7)  # 17 tokens: pages 3 and 4 are new
    generate(ev523.engine, longer)
    ext = page_hashes(longer, 4)
    assert batch_events(ev523.recv()[1]) == [{
        "type": "BlockStored", "block_hashes": ext[2:], "parent_block_hash": ext[1], "token_ids": longer[8:16],
        "block_size": 4, "lora_id": None, "medium": "GPU"}]
    assert ev523.flush()[1] == [{"type": "AllBlocksCleared"}]


@pytest.mark.parametrize("which", ["ev58", "ev523"])
def test_eviction_forgets_the_least_recently_used_prefix_and_publishes_its_removal(
        request: pytest.FixtureRequest, which: str) -> None:
    ev: Events = request.getfixturevalue(which)
    page = 1 if which == "ev58" else 4
    eng = ev.engine
    ev.flush()
    evicted_before = cache_stats(eng)["evicted_pages"]
    x, y, z = fresh(80), fresh(80), fresh(80)
    generate(eng, x)
    generate(eng, y)
    assert generate(eng, x)["cached_tokens"] == 79 // page * page  # x is now more recent than y
    ev.drain()
    generate(eng, z)  # 240 > 200 tokens: y, the least recently used leaf, goes
    events = batch_events(ev.recv()[1])
    if page == 1:
        assert events[:80] == [["BlockRemoved", [h]] for h in page_hashes(y, 1)]
        assert [e[0] for e in events[80:]] == ["BlockStored"] * 80
    else:
        assert events[0] == {"type": "BlockRemoved", "block_hashes": page_hashes(y, 4), "medium": "GPU"}
        assert events[1]["type"] == "BlockStored" and events[1]["block_hashes"] == page_hashes(z, 4)
    stats = cache_stats(eng)
    assert stats == {"pages": 160 // page, "tokens": 160, "capacity_tokens": CACHE_TOKENS,
                     "evicted_pages": evicted_before + 80 // page}
    assert generate(eng, x)["cached_tokens"] == 79 // page * page
    assert generate(eng, y)["cached_tokens"] == 0


# sequence numbers, replay and the hooks

@pytest.mark.parametrize("which", ["ev58", "ev523"])
def test_sequence_numbers_are_contiguous_and_replay_ends_with_minus_one(
        request: pytest.FixtureRequest, which: str) -> None:
    ev: Events = request.getfixturevalue(which)
    ev.drain()
    live = []
    for _ in range(3):
        generate(ev.engine, fresh(6))
        live.append(ev.recv())
    seqs = [s for s, _ in live]
    assert seqs == list(range(seqs[0], seqs[0] + 3))
    assert ev.replay(seqs[0]) == live  # the same payloads, nothing after them
    assert ev.replay(seqs[2] + 1) == []  # only the end marker
    first = ev.replay(0)
    assert [s for s, _ in first] == list(range(0, seqs[2] + 1))  # seq 0 onwards, all buffered
    assert batch_events(first[0][1]) in ([["AllBlocksCleared"]], [{"type": "AllBlocksCleared"}])  # at startup


@pytest.mark.parametrize("which", ["ev58", "ev523"])
def test_drop_next_leaves_a_gap_that_replay_fills(request: pytest.FixtureRequest, which: str) -> None:
    ev: Events = request.getfixturevalue(which)
    ev.drain()
    generate(ev.engine, fresh(8))
    before, _ = ev.recv()
    hooks(ev.engine, drop_next=2)
    prompts = [fresh(8) for _ in range(3)]
    for p in prompts:
        generate(ev.engine, p)
    after, payload = ev.recv()
    assert after == before + 3 and ev.quiet()  # before+1 and before+2 never came
    missing = ev.replay(before + 1)
    assert [s for s, _ in missing] == [before + 1, before + 2, before + 3] and missing[2][1] == payload
    for (_, data), p in zip(missing, prompts):
        assert stored_hashes(batch_events(data)) == page_hashes(p, 1 if which == "ev58" else 4)


def test_malformed_next_sends_garbage_under_its_own_sequence_number(ev523: Events) -> None:
    ev523.drain()
    hooks(ev523.engine, malformed_next=1)
    prompt = fresh(8)
    generate(ev523.engine, prompt)
    seq, garbage = ev523.recv()
    with pytest.raises(msgspec.DecodeError):
        msgspec.msgpack.decode(garbage)
    generate(ev523.engine, fresh(8))
    nxt, good = ev523.recv()
    assert nxt == seq + 1 and stored_hashes(batch_events(good))
    (replayed_seq, real), _ = ev523.replay(seq)
    assert replayed_seq == seq and stored_hashes(batch_events(real)) == page_hashes(prompt, 4)  # the buffer kept it


def test_pause_publishes_nothing_and_numbers_nothing(ev58: Events) -> None:
    ev58.drain()
    generate(ev58.engine, fresh(3))
    before, _ = ev58.recv()
    hooks(ev58.engine, pause=True)
    try:
        generate(ev58.engine, fresh(3))
        assert ev58.quiet()
    finally:
        hooks(ev58.engine, pause=False)
    generate(ev58.engine, fresh(3))
    after, _ = ev58.recv()
    assert after == before + 1  # no gap to detect: the paused batch is simply gone
    assert [s for s, _ in ev58.replay(before)] == [before, after]
    assert httpx.post(ev58.engine.url + "/emu/kv_events", json={"pause": "yes"}).status_code == 400


def test_server_info_reports_the_publisher(engines: dict[str, RunningEngine], ports: dict[str, int]) -> None:
    old = httpx.get(engines["v058"].url + "/server_info").json()
    new = httpx.get(engines["v0523"].url + "/server_info").json()
    assert msgspec.json.decode(old["kv_events_config"])["endpoint"] == f"tcp://*:{ports['pub58']}"
    assert "kv_events" not in old and old["enable_cache_report"] is True and old["page_size"] == 1
    assert new["kv_events"] == {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": ports["pub523"],
                                "topic": "kv@eng", "block_size": 4, "dp_size": 1,
                                "replay_endpoint_port_base": ports["rep523"]}
    assert httpx.get(engines["prefill"].url + "/server_info").json()["kv_events"] is None


# the prefill timeline

def test_prefills_queue_on_one_timeline_and_cached_tokens_are_free(engines: dict[str, RunningEngine]) -> None:
    eng = engines["prefill"]
    one = 400 / RATE  # seconds of compute for 400 uncached tokens
    a, b = fresh(400), fresh(400)

    def timed(ids: list[int]) -> tuple[float, int]:
        t0 = time.monotonic()
        cached = generate(eng, ids)["cached_tokens"]
        return time.monotonic() - t0, cached

    with ThreadPoolExecutor(3) as pool:
        first, second = pool.submit(timed, a), pool.submit(timed, b)
        time.sleep(one / 2)
        loads = httpx.get(eng.url + "/v1/loads").json()["loads"][0]
        durations = sorted([first.result()[0], second.result()[0]])
    assert durations[0] >= one * 0.95 and durations[1] >= 2 * one * 0.95  # the second waited for the first
    assert loads["num_waiting_reqs"] == 1 and loads["queues"]["waiting"] == 1
    assert loads["num_waiting_uncached_tokens"] == 400
    elapsed, cached = timed(a)
    assert cached == 399 and elapsed < one * 0.9  # one uncached token
    after = httpx.get(eng.url + "/v1/loads").json()["loads"][0]
    assert after["total_prefill_uncached_tokens"] >= 801 and after["total_prefill_busy_us"] >= 2 * one * 1e6 * 0.99
    assert after["cache_hit_rate"] == round(399 / 400, 4)


# the decode's preallocation queue

def test_decode_prealloc_is_fifo_with_reserved_tokens(engines: dict[str, RunningEngine]) -> None:
    eng = engines["decode"]  # 2048 tokens, 512 reserved per admission, 1 ms per output token

    def run(rid: str, prompt: int, max_new: int) -> None:
        status, body = post(eng, "/generate", {"rid": rid, "input_ids": fresh(prompt),
                                               "sampling_params": {"max_new_tokens": max_new}})
        assert status == 200, body

    with ThreadPoolExecutor(3) as pool:
        holder = pool.submit(run, "hol-a", 100, 1000)  # holds 1,100 tokens for about a second
        time.sleep(0.3)
        big = pool.submit(run, "hol-b", 100, 500)  # 600 fit the 948 free, 600 + 512 do not: it waits
        time.sleep(0.1)
        small = pool.submit(run, "hol-c", 10, 10)  # 20 + 512 would fit, but it queues behind b
        time.sleep(0.2)
        loads = httpx.get(eng.url + "/v1/loads").json()["loads"][0]
        state = httpx.get(eng.url + "/emu/state").json()
        for f in (holder, big, small):
            f.result()
    assert loads["disaggregation"]["decode_prealloc_queue_reqs"] == 2 and loads["queues"]["prealloc_ready"] == 2
    assert loads["num_waiting_reqs"] == 2 and loads["num_used_tokens"] == 1100
    assert loads["num_prealloc_ready_tokens"] == 110 and state["waiting_allocations"] == 2
    records = {r["rid"]: r for r in httpx.get(eng.url + "/emu/requests?rid=hol-").json()["requests"]}
    assert records["hol-c"]["end"] > records["hol-a"]["end"]


def test_the_decode_reports_the_prefills_cached_tokens(engines: dict[str, RunningEngine]) -> None:
    prefill, decode = engines["prefill"], engines["decode"]
    body = {"input_ids": fresh(60), "sampling_params": {"max_new_tokens": 2}}
    assert post_pd(prefill, decode, "/generate", body)["meta_info"]["cached_tokens"] == 0
    assert post_pd(prefill, decode, "/generate", body)["meta_info"]["cached_tokens"] == 59
