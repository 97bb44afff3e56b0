"""Can one request stall the gateway? `python -m loadtests.loop_bench`.

Starts an emulated PD pair in bug mode (KV pool 4,096 tokens, context 8,192: the gateway clamps the limit to 4,089)
and `kvgate serve` in its own process, then sends bodies built to be worst cases for each admission step — up to
`max_body_bytes` (64 MiB by default) of one repeated character, spaces, added tokens, escapes, tiny messages, content
parts, token ids, empty arrays, deep nesting — one at a time, while a prober thread asks `GET /healthz` every 5 ms
on a keep-alive connection. For each body it prints the answer's status and time and the /healthz latencies seen
meanwhile; the last line (read by tools) is `healthz_p99_ms=… healthz_max_ms=… bodies=…`. Targets: p99 ≤ 10 ms,
max ≤ 50 ms.

Then the engine side: a decode that streams one 50 MB event without a blank line, and a prefill answering a 50 MB
body (`--engine-mb`), each to an ordinary chat: the request must get 502 (the gateway reads up to the model's
`limits.engine_event_bytes` / `engine_answer_bytes`), with the same /healthz targets meanwhile.

    python -m loadtests.loop_bench                 # every case at 64 MiB (~2 minutes on 2 cores)
    python -m loadtests.loop_bench --max-mib 8     # quicker
"""

from __future__ import annotations

import argparse
import http.client
import multiprocessing
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from loadtests.engine.harness import EnginePair, free_port, start_pair

REPO_ROOT = Path(__file__).resolve().parents[1]
GLM5_TOKENIZER = REPO_ROOT / "config/models/glm-5/tokenizer.json.gz"
GLM5_TEMPLATE = REPO_ROOT / "config/models/glm-5/chat_template.jinja"
PROBE_INTERVAL_S = 0.005
_CHAT_HEAD = b'{"model":"glm-5","max_tokens":4,"messages":[{"role":"user","content":"'
_CHAT_TAIL = b'"}]}'


def _fill(head: bytes, unit: bytes, tail: bytes, size: int, sep: bytes = b"") -> bytes:
    count = max(1, (size - len(head) - len(tail)) // (len(unit) + len(sep)))
    return head + sep.join([unit] * count) + tail if sep else head + unit * count + tail


def worst_case_bodies(size: int) -> Iterator[tuple[str, str, Callable[[], bytes]]]:
    """(name, route, builder) for each adversarial body of about `size` bytes."""
    chat = "/v1/chat/completions"
    text = [("one_char", b"a"), ("spaces", b" "), ("newlines", b"\\n"), ("added_tokens", b"<|user|>"),
            ("token_prefixes", b"<|"), ("cjk_no_punct", "你".encode()), ("unicode_escapes", b"\\u4f60"),
            ("punct_run", b".,;:!?"), ("emoji", "😀".encode())]
    for name, unit in text:
        yield f"chat_{name}", chat, lambda unit=unit: _fill(_CHAT_HEAD, unit, _CHAT_TAIL, size)
    yield "chat_tiny_messages", chat, lambda: _fill(b'{"model":"glm-5","messages":[', b'{"role":"user","content":"a"}',
                                                    b"]}", size, sep=b",")
    yield "chat_tiny_assistant_turns", chat, lambda: _fill(
        b'{"model":"glm-5","messages":[', b'{"role":"user","content":"a"},{"role":"assistant","content":"b"}',
        b',{"role":"user","content":"q"}]}', size, sep=b",")
    yield "chat_content_parts", chat, lambda: _fill(b'{"model":"glm-5","messages":[{"role":"user","content":[',
                                                    b'{"type":"text","text":"a"}', b"]}]}", size, sep=b",")
    yield "chat_empty_arrays", chat, lambda: _fill(
        b'{"model":"glm-5","messages":[{"role":"user","content":"a"}],"response_format":{"x":[', b"[]", b"]}}",
        size, sep=b",")
    yield "chat_many_tools", chat, lambda: _fill(
        b'{"model":"glm-5","messages":[{"role":"user","content":"a"}],"tools":[',
        b'{"type":"function","function":{"name":"f","description":"' + b"d" * 200 + b'","parameters":{}}}',
        b"]}", size, sep=b",")
    yield "chat_deep_nesting", chat, lambda: (
        b'{"model":"glm-5","messages":[{"role":"user","content":"a"}],"chat_template_kwargs":{"enable_thinking":'
        + b"[" * 1000 + b"]" * 1000 + b"}}")
    yield "completion_ids", "/v1/completions", lambda: _fill(b'{"model":"glm-5","prompt":[', b"1", b"]}", size,
                                                             sep=b",")
    yield "completion_text", "/v1/completions", lambda: _fill(b'{"model":"glm-5","prompt":"', b"ab ", b'"}', size)
    yield "generate_ids", "/generate", lambda: _fill(b'{"input_ids":[', b"100", b"]}", size, sep=b",")
    yield "generate_ids_just_fit", "/generate", lambda: (
        b'{"sampling_params":{"max_new_tokens":1},"input_ids":[' + b",".join([b"100"] * 4089) + b"]}")


class Probe:
    """GET /healthz every PROBE_INTERVAL_S on one keep-alive connection, from a process of its own (so the
    sender's work never delays a probe); samples are (monotonic time sent, latency s)."""

    def __init__(self, host: str, port: int) -> None:
        context = multiprocessing.get_context("fork")
        self._stop = context.Event()
        self._receiver, sender = context.Pipe(duplex=False)
        self._process = context.Process(target=_probe, args=(host, port, self._stop, sender), daemon=True)
        self.samples: list[tuple[float, float]] = []

    def window(self, start: float, end: float) -> list[float]:
        return [latency for sent, latency in self.samples if start <= sent <= end]

    @contextmanager
    def running(self) -> Iterator[Probe]:
        self._process.start()
        try:
            yield self
        finally:
            self._stop.set()
            self.samples = self._receiver.recv()
            self._process.join(timeout=15)


def _probe(host: str, port: int, stop: Any, results: Any) -> None:
    samples: list[tuple[float, float]] = []
    connection = http.client.HTTPConnection(host, port, timeout=10)
    while not stop.is_set():
        sent, start = time.monotonic(), time.perf_counter()
        try:
            connection.request("GET", "/healthz")
            connection.getresponse().read()
            samples.append((sent, time.perf_counter() - start))
        except (OSError, http.client.HTTPException):
            samples.append((sent, float("inf")))
            connection.close()
            connection = http.client.HTTPConnection(host, port, timeout=10)
        time.sleep(PROBE_INTERVAL_S)
    connection.close()
    results.send(samples)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def post(host: str, port: int, route: str, body: bytes) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection(host, port, timeout=600)
    try:
        connection.request("POST", route, body=body, headers={"content-type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def write_config(directory: Path, pair: EnginePair, max_body_bytes: int) -> tuple[Path, int]:
    port = free_port()
    document = {"listen": {"host": "127.0.0.1", "port": port}, "max_body_bytes": max_body_bytes,
                "health": {"interval_s": 1.0, "timeout_s": 5.0},
                "models": [{"name": "glm-5", "tokenizer": str(GLM5_TOKENIZER), "chat_template": str(GLM5_TEMPLATE),
                            "context_length": 8192, "on_pool_mismatch": "clamp", "default_max_tokens": 4,
                            "prefill": [{"url": pair.prefill.url, "bootstrap_port": pair.prefill.bootstrap_port}],
                            "decode": [{"url": pair.decode.url}]}]}
    path = directory / "kvgate-loop-bench.yaml"
    path.write_text(yaml.safe_dump(document))
    return path, port


@contextmanager
def running_gateway_process(config: Path, port: int) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
                                "--log-level", "warning"], cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the gateway did not start") from None
                time.sleep(0.1)
        yield process
    finally:
        process.terminate()
        process.wait(timeout=30)


def measure(port: int, size: int, *, only: set[str] | None = None,
            report: Callable[[str], None] = print) -> tuple[list[float], list[tuple[str, int]]]:
    """Send every worst case (one at a time) while probing; all probe latencies and each case's status."""
    all_latencies: list[float] = []
    statuses: list[tuple[str, int]] = []
    # Warm-up: the first large body starts the admission worker process; that is setup, not a request's stall.
    post("127.0.0.1", port, "/v1/completions", _fill(b'{"model":"glm-5","prompt":"', b"ab ", b'"}', 128 * 1024))
    probe = Probe("127.0.0.1", port)
    cases: list[tuple[str, int, float, float, float, bytes]] = []
    with probe.running():
        for name, route, build in worst_case_bodies(size):
            if only and name not in only:
                continue
            body = build()
            start = time.monotonic()
            status, answer = post("127.0.0.1", port, route, body)
            end = time.monotonic()
            cases.append((name, status, start, end, len(body) / 2**20, answer))
            time.sleep(0.05)
    for name, status, start, end, mib, answer in cases:
        lat = probe.window(start, end + 0.05)
        all_latencies.extend(lat)
        statuses.append((name, status))
        report(_case_line(name, f"{mib:7.1f} MiB", status, end - start, lat, answer))
    return all_latencies, statuses


def _case_line(name: str, size: str, status: int, took_s: float, lat: list[float], answer: bytes) -> str:
    return (f"{name:28s} {size} -> {status} in {took_s:6.2f}s   /healthz n={len(lat):4d} "
            f"p50={1000 * percentile(lat, 50):5.1f}ms p99={1000 * percentile(lat, 99):5.1f}ms "
            f"max={1000 * max(lat, default=float('nan')):6.1f}ms   {answer[:70]!r}")


ENGINE_CASES = (("decode_huge_event", "decode"), ("prefill_huge_body", "prefill"))


def measure_engine_side(port: int, pair: EnginePair, size: int, *, only: set[str] | None = None,
                        report: Callable[[str], None] = print) -> tuple[list[float], list[tuple[str, int]]]:
    """Each engine case (the emulator's `huge` fault on one half) under an ordinary chat, while probing."""
    all_latencies: list[float] = []
    statuses: list[tuple[str, int]] = []
    chat = b'{"model":"glm-5","max_tokens":4,"messages":[{"role":"user","content":"Hello"}]}'
    probe = Probe("127.0.0.1", port)
    cases: list[tuple[str, int, float, float, bytes]] = []
    with probe.running():
        for name, role in ENGINE_CASES:
            if only and name not in only:
                continue
            engine = pair.prefill if role == "prefill" else pair.decode
            host, engine_port = engine.url.rsplit("/", 1)[1].split(":")
            fault = b'{"action":"huge","size":%d,"rid_prefix":"kvg-","count":1}' % size
            assert post(host, int(engine_port), "/emu/faults", fault)[0] == 200
            start = time.monotonic()
            status, answer = post("127.0.0.1", port, "/v1/chat/completions", chat)
            end = time.monotonic()
            cases.append((name, status, start, end, answer))
            time.sleep(0.3)  # the engine still writing into a closed connection, then the aborts
    for name, status, start, end, answer in cases:
        lat = probe.window(start, end + 0.3)
        all_latencies.extend(lat)
        statuses.append((name, status))
        report(_case_line(name, f"{size / 1e6:7.1f} MB ", status, end - start, lat, answer))
    return all_latencies, statuses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.loop_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--max-mib", type=float, default=64.0, help="size of each worst-case body (MiB)")
    parser.add_argument("--only", nargs="*", default=None, help="run only these cases")
    parser.add_argument("--engine-mb", type=float, default=50.0, help="size of the engine-side cases' answers (MB)")
    args = parser.parse_args(argv)
    size = int(args.max_mib * 2**20)
    with tempfile.TemporaryDirectory() as tmp, \
            start_pair(prefill_pool=4096, decode_pool=4608, context_length=8192, model="glm-5", bug=True) as pair:
        config, port = write_config(Path(tmp), pair, max_body_bytes=size + 1024)
        only = set(args.only) if args.only else None
        with running_gateway_process(config, port):
            latencies, statuses = measure(port, size, only=only)
            engine_latencies, engine_statuses = measure_engine_side(port, pair, int(args.engine_mb * 1e6), only=only)
    if engine_statuses:
        print(f"engine_healthz_p99_ms={1000 * percentile(engine_latencies, 99):.1f} "
              f"engine_healthz_max_ms={1000 * max(engine_latencies):.1f} "
              f"engine_statuses={','.join(str(status) for _, status in engine_statuses)}")
    latencies += engine_latencies
    print(f"healthz_p99_ms={1000 * percentile(latencies, 99):.1f} healthz_max_ms={1000 * max(latencies):.1f} "
          f"bodies={len(statuses)} engine_cases={len(engine_statuses)}")
    return 0 if all(status == 502 for _, status in engine_statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
