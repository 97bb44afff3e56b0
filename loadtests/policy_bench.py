"""What a load-balancing policy adds to the gateway's CPU per request: `python -m loadtests.policy_bench`.

Each policy picks a prefill/decode pair (and takes and releases its lease, as every request does) over pools of 8
workers each, with some requests in flight so load-aware policies have something to compare. prefix_affinity also
pays for hashing the prompt's first token ids at admission (64 by default): measured on a chat rendering. The figures
are set against round_robin, and against the gateway's own CPU per request (`loadtests.bench`, ~0.5–1 ms), which a
policy must not measurably move.

cache_aware is measured as it runs: a 4k-token prompt whose conversation one of 4 prefills holds (the others hold
other conversations), split into the prompt's block keys (once per request) and the pick itself; what its token ids
cost at admission (a next chat turn, whose earlier pieces are cached, and a new 4k-token text); and the index's
memory per cached block (Python objects counted by tracemalloc).

Final lines (machine-readable): `policy=NAME pick_us=… vs_round_robin_us=…`, `prefix_hash_us=…`, then
`cache_aware_keys_4k_us=…`, `cache_aware_pick_4k_us=…`, `route_ids_next_turn_us=…`, `route_ids_new_4k_us=…`,
`index_bytes_per_block=…`, `index_bytes_per_page_size1=…`.
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc
from array import array

from gateway.admission.counting import TokenCounter
from gateway.admission.prompt_ids import PromptIds
from gateway.admission.tokenizer import ModelTokenizer
from loadtests.procstat import GLM5_TOKENIZER
from routing.engines.identity import EngineIdentity
from routing.policies import POLICIES, RouteKey, make_policy
from routing.policies.cache_aware import CacheAware
from routing.pools import ModelPool
from routing.prefix_index import CacheIndex, PromptTokens
from routing.prefix_index.blocks import ids_to_bytes
from routing.stable_hash import stable_hash
from routing.workers import Worker, WorkerSpec

WORKERS = 8
IDENTITY = EngineIdentity(681280, 681274, 1, "0.5.23", "decode", "glm-5", "/t", 1048576)


def _pool(policy: str) -> ModelPool:
    def workers(role: str) -> list[Worker]:
        made = [Worker(WorkerSpec(f"http://10.0.{role == 'decode'}.{i}:30000", role)) for i in range(WORKERS)]  # type: ignore[arg-type]
        for index, worker in enumerate(made):
            worker.accept(IDENTITY)
            worker.record_engine_load(1000 * index)
        return made

    return ModelPool("bench", workers("prefill"), workers("decode"),
                     prefill_policy=make_policy(policy, load_max_age_s=3600),
                     decode_policy=make_policy(policy, load_max_age_s=3600))


def pick_cost_us(policy: str, n: int) -> float:
    pool = _pool(policy)
    rng = random.Random(7)
    keys = [RouteKey(prefix=rng.getrandbits(64), session=rng.getrandbits(64)) for _ in range(1024)]
    held = [pool.pick_pair(keys[i]) for i in range(3 * WORKERS)]  # some load in flight
    start = time.perf_counter()
    for i in range(n):
        pool.pick_pair(keys[i & 1023]).release()
    elapsed = time.perf_counter() - start
    for lease in held:
        lease.release()
    return elapsed / n * 1e6


def prefix_hash_us(n: int, prefix_tokens: int = 64) -> float:
    tokenizer = ModelTokenizer.load(GLM5_TOKENIZER).tokenizer
    text = "[gMASK]<sop><|system|>\nYou are a helpful assistant for Example Corp. " * 40
    start = time.perf_counter()
    for _ in range(n):  # as Admission._prefix_hash: a window of 4 characters a token holds enough of this prose
        ids = tokenizer.encode_batch_fast([text[: prefix_tokens * 4]], add_special_tokens=False)[0].ids
        stable_hash(array("q", ids[:prefix_tokens]).tobytes(), b"")
    return (time.perf_counter() - start) / n * 1e6


def cache_aware_us(n: int) -> tuple[float, float]:
    """(block keys of a 4k-token prompt, pick among 4 prefills) in µs, each prefill holding 64 conversations."""
    rng = random.Random(11)
    identity = EngineIdentity(681280, 681274, 1, "0.5.23", "prefill", "glm-5", "/t", 1048576)
    pool = []
    for i in range(4):
        worker = Worker(WorkerSpec(f"http://10.0.2.{i}:30000", "prefill"))
        worker.accept(identity)
        worker.cache_index = CacheIndex(page_size=1, capacity_tokens=identity.pool_tokens)
        pool.append(worker)
    system = [rng.randrange(150_000) for _ in range(512)]
    conversations = [system + [rng.randrange(150_000) for _ in range(3500)] for _ in range(256)]
    for i, ids in enumerate(conversations):
        assert pool[i % 4].cache_index is not None
        pool[i % 4].cache_index.record(PromptTokens(ids_to_bytes(ids), tokens=len(ids), namespace="t"))
    policy = CacheAware()
    prompts = [ids_to_bytes(c + [1] * 96) for c in conversations]
    start = time.perf_counter()
    for i in range(n):
        PromptTokens(prompts[i & 255], tokens=4096, namespace="t").keys(32)
    keys_us = (time.perf_counter() - start) / n * 1e6
    made = []
    for i in range(n):
        prompt = PromptTokens(prompts[i & 255], tokens=4096, namespace="t")
        prompt.keys(32)
        made.append(prompt)
    start = time.perf_counter()
    for prompt in made:
        policy.pick(pool, RouteKey(prompt=prompt))
    return keys_us, (time.perf_counter() - start) / n * 1e6


def route_ids_us(n: int) -> tuple[float, float]:
    """Routing ids at admission: (a next chat turn, a new 4k-token text) in µs."""
    tokenizer = ModelTokenizer.load(GLM5_TOKENIZER)
    counter = TokenCounter(tokenizer, cache_bytes=1 << 20)
    builder = PromptIds(tokenizer, counter.splitter)
    turns = "[gMASK]<sop><|system|>You are a helpful assistant." + "".join(
        f"<|user|>Question {i}: what about the {i}th thing on the list, and why?<|assistant|>" + "An answer. " * 40
        for i in range(12))
    builder.ids(turns, tenant="t", special=False, max_tokens=65536)
    start = time.perf_counter()
    for i in range(n):
        builder.ids(turns + f"<|user|>and {i}?<|assistant|>", tenant="t", special=False, max_tokens=65536)
    next_turn = (time.perf_counter() - start) / n * 1e6
    rng = random.Random(3)
    words = ["sea", "sky", "river", "stone", "light", "wind", "tree", "cloud"]
    texts = [" ".join(rng.choice(words) for _ in range(4000)) + f" {i}" for i in range(max(1, n // 10))]
    start = time.perf_counter()
    for text in texts:
        builder.ids(text, tenant="t", special=True, max_tokens=65536)
    new = (time.perf_counter() - start) / len(texts) * 1e6
    counter.close()
    return next_turn, new


def index_bytes_per_block(page_size: int) -> float:
    rng = random.Random(5)
    index = CacheIndex(page_size=page_size, capacity_tokens=10_000_000)
    prompts = [PromptTokens(ids_to_bytes([rng.randrange(150_000) for _ in range(4097)]), tokens=4097, namespace="t")
               for _ in range(200)]
    for prompt in prompts:
        prompt.keys(index.block_tokens)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for prompt in prompts:
        index.record(prompt)
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return grown / index.sent_blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--picks", type=int, default=100_000)
    args = parser.parse_args()
    costs = {name: pick_cost_us(name, args.picks) for name in POLICIES}
    baseline = costs["round_robin"]
    print(f"pools of {WORKERS} prefill + {WORKERS} decode workers, {args.picks} picks per policy (pick + lease)")
    for name, cost in costs.items():
        print(f"policy={name} pick_us={cost:.2f} vs_round_robin_us={cost - baseline:+.2f}")
    print(f"prefix_hash_us={prefix_hash_us(2000):.1f}")
    keys_us, pick_us = cache_aware_us(2000)
    next_turn_us, new_us = route_ids_us(500)
    per_block = index_bytes_per_block(1)
    print(f"cache_aware_keys_4k_us={keys_us:.1f}")
    print(f"cache_aware_pick_4k_us={pick_us:.1f}")
    print(f"route_ids_next_turn_us={next_turn_us:.1f}")
    print(f"route_ids_new_4k_us={new_us:.1f}")
    print(f"index_bytes_per_block={per_block:.1f}")
    print(f"index_bytes_per_page_size1={per_block / 32:.1f}")
    print(f"index_bytes_per_page_size64={index_bytes_per_block(64):.1f}")


if __name__ == "__main__":
    main()
