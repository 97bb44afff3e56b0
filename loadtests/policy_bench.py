"""What a load-balancing policy adds to the gateway's CPU per request: `python -m loadtests.policy_bench`.

Each policy picks a prefill/decode pair (and takes and releases its lease, as every request does) over pools of 8
workers each, with some requests in flight so load-aware policies have something to compare. prefix_affinity also
pays for hashing the prompt's first token ids at admission (64 by default): measured on a chat rendering. The figures are set
against round_robin, and against the gateway's own CPU per request (`loadtests.bench`, ~0.5–1 ms), which a
policy must not measurably move.

Final lines (machine-readable): `policy=NAME pick_us=… vs_round_robin_us=…`, then `prefix_hash_us=…`.
"""

from __future__ import annotations

import argparse
import random
import time
from array import array

from gateway.admission.tokenizer import ModelTokenizer
from loadtests.procstat import GLM5_TOKENIZER
from routing.engines.identity import EngineIdentity
from routing.policies import POLICIES, RouteKey, make_policy
from routing.pools import ModelPool
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


if __name__ == "__main__":
    main()
