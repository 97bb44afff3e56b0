"""Benchmark exact long-context counting: `python -m loadtests.count_bench`.

Builds a realistic ~1,000,000-token multi-turn chat (English prose, code, CJK, tool calls), renders it with
the GLM-5 chat template, and measures: a cold count (empty cache), a warm count of the same conversation plus
one new ~2,000-token message, event-loop lag while small concurrent requests are counted, and equality of
every count with single-pass `Tokenizer.encode`. The last four lines are the machine-readable results.

`python -m loadtests.count_bench --lag [MB]` instead measures the event loop's lag (a 1 ms heartbeat) while
adversarial texts of MB million characters (default 64) are counted, one at a time and several at once:
runs of one character, whitespace, added tokens and their prefixes, punctuation, CJK without punctuation, and
all of these mixed. `--check` also compares each count with single-pass `encode_batch_fast` (needs time and,
for 64 MB, tens of GB).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import random
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from gateway.admission.counting import TokenCounter, UnencodableText
from gateway.admission.tokenizer import ModelTokenizer

MODEL_DIR = Path(__file__).resolve().parents[1] / "config" / "models" / "glm-5"
TARGET_TOKENS = 1_000_000
NEW_MESSAGE_TOKENS = 2_000
IDLE_S = 20.0  # heartbeat alone before the adversarial scenario: the machine's own lag
SMALL_RPS = 100  # small prompts (50-1,500 tokens) arriving per second while the long one is counted
CJK_SENTENCES = (
    "这个函数在处理长上下文时会把整个提示词重新编码一遍，所以延迟随着对话长度线性增长。",
    "请帮我检查一下这段代码里有没有并发问题，尤其是锁的获取顺序。",
    "网关在把请求转发给预填充节点之前，必须先确认提示词能放进显存里的键值缓存。",
    "我们在压力测试中发现，当并发请求超过两百个时，尾延迟明显上升。",
    "日志显示解码节点在第三次重试后才成功建立连接，这说明健康检查的间隔太长了。",
    "如果租户的配额已经用完，应该返回明确的错误码，而不是让请求一直排队。",
    "東京の開発チームは、この変更が既存のクライアントとの互換性を壊さないことを確認しました。",
    "キャッシュのヒット率は午前中に九十パーセントを超えましたが、夕方には下がりました。",
    "한국어 사용자도 많기 때문에 다국어 토큰화 성능을 꼭 확인해야 합니다.",
    "总结：把计数结果按租户缓存，新消息只需要编码新增的部分。🚀✅",
)


def _stdlib_sources() -> tuple[list[str], list[str]]:
    """Code files and English docstrings from the standard library: real text, always installed."""
    code: list[str] = []
    prose: list[str] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        source = path.read_text(encoding="utf-8", errors="replace")
        code.append(source)
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    prose.append(doc)
    return code, prose


class ChatBuilder:
    def __init__(self, seed: int = 5) -> None:
        self._rng = random.Random(seed)
        self._code, self._docs = _stdlib_sources()

    def _code_block(self, chars: int) -> str:
        src = self._rng.choice(self._code)
        start = self._rng.randrange(max(1, len(src) - chars))
        return "```python\n" + src[start : start + chars] + "\n```"

    def _prose(self, chars: int) -> str:
        out: list[str] = []
        while sum(map(len, out)) < chars:
            out.append(self._rng.choice(self._docs))
        return "\n\n".join(out)

    def _cjk(self, sentences: int) -> str:
        return "".join(self._rng.choice(CJK_SENTENCES) for _ in range(sentences))

    def message_text(self, chars: int) -> str:
        parts = [self._prose(chars // 3), self._cjk(max(1, chars // 300)), self._code_block(chars // 2)]
        self._rng.shuffle(parts)
        return "\n\n".join(parts)

    def turn(self, chars: int) -> list[dict[str, Any]]:
        user = {"role": "user", "content": self.message_text(chars)}
        if self._rng.random() < 0.25:
            call = {"function": {"name": "read_file", "arguments": {"path": "src/app.py", "lines": [1, 400]}}}
            tool_out = {"role": "tool", "content": self._code_block(chars)}
            assistant = {"role": "assistant", "content": "Let me read the file.", "tool_calls": [call]}
            answer = {"role": "assistant", "content": self.message_text(chars // 2)}
            return [user, assistant, tool_out, answer]
        return [user, {"role": "assistant", "content": self.message_text(chars // 2)}]


def render_template(model_dir: Path) -> jinja2.Template:
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    # HF's tojson accepts ensure_ascii; jinja2's does not.
    env.filters["tojson"] = lambda v, ensure_ascii=True, **_: json.dumps(v, ensure_ascii=ensure_ascii)
    return env.from_string((model_dir / "chat_template.jinja").read_text(encoding="utf-8"))


def render(template: jinja2.Template, messages: list[dict[str, Any]]) -> str:
    return template.render(messages=messages, add_generation_prompt=True)


class LagProbe:
    """Samples how late a 1 ms sleep wakes up: the event loop's responsiveness."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = asyncio.Event()

    async def run(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            self.samples.append((time.perf_counter() - t - 0.001) * 1000)

    def stop(self) -> None:
        self._stop.set()


async def small_requests(
    counter: TokenCounter, texts: list[str], stop: asyncio.Event, seen: list[tuple[str, int]]
) -> None:
    """Open-loop arrivals at SMALL_RPS, each a unique (uncached) small prompt, counted concurrently."""

    async def one(i: int) -> None:
        text = f"{texts[i % len(texts)]} #{id(seen)}-{i}"
        seen.append((text, await counter.count(text, tenant=f"small-{i % 7}")))

    inflight: list[asyncio.Task[None]] = []
    i = 0
    start = time.perf_counter()
    while not stop.is_set():
        inflight.append(asyncio.create_task(one(i)))
        i += 1
        await asyncio.sleep(max(0.0, start + i / SMALL_RPS - time.perf_counter()))
    await asyncio.gather(*inflight)


async def measure(
    counter: TokenCounter, prompt: str, small: list[str]
) -> tuple[int, float, list[float], list[tuple[str, int]]]:
    """Count `prompt` while a lag probe runs and small requests arrive; returns count, wall s, lags, smalls."""
    probe, stop, seen = LagProbe(), asyncio.Event(), []
    tasks = [asyncio.create_task(probe.run()), asyncio.create_task(small_requests(counter, small, stop, seen))]
    await asyncio.sleep(0.05)
    t = time.perf_counter()
    n = await counter.count(prompt, tenant="bench")
    wall = time.perf_counter() - t
    probe.stop()
    stop.set()
    await asyncio.gather(*tasks)
    return n, wall, probe.samples, seen


def cold_counter(mt: ModelTokenizer) -> TokenCounter:
    """A counter with an empty count cache, and `tokenizers`' own BPE word cache emptied too."""
    clear = getattr(mt.tokenizer.model, "_clear_cache", None)
    if clear is not None:
        clear()
    return TokenCounter(mt)


def p99(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=100)[98] if len(samples) > 1 else (samples or [0.0])[0]


def build_chat(tok: Any, template: jinja2.Template, builder: ChatBuilder) -> tuple[list[dict[str, Any]], str, int]:
    """Messages rendering to at least TARGET_TOKENS tokens; returns messages, prompt, exact token count."""
    system = "You are a careful senior engineer. 你是一名资深工程师。"
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    chars = 0
    while chars < TARGET_TOKENS * 3.4:
        turn = builder.turn(random.Random(len(messages)).randrange(2_000, 30_000))
        messages += turn
        chars += sum(len(m["content"]) for m in turn)
    while True:
        prompt = render(template, messages)
        n = len(tok.encode(prompt, add_special_tokens=False).ids)
        if n >= TARGET_TOKENS:
            return messages, prompt, n
        messages += builder.turn(8_000)


def new_message(tok: Any, builder: ChatBuilder) -> str:
    text = builder.message_text(9_000)
    while len(tok.encode(text).ids) > NEW_MESSAGE_TOKENS:
        text = text[: int(len(text) * 0.98)]
    return text


async def main() -> None:
    t = time.perf_counter()
    mt = ModelTokenizer.load(MODEL_DIR / "tokenizer.json.gz")
    tok = mt.tokenizer
    print(f"tokenizer loaded in {time.perf_counter() - t:.2f}s, identity {mt.identity[:16]}…")
    print(f"tokens_le_bytes={mt.tokens_le_bytes} segmentable={mt.segmentable} pretok_cuttable={mt.pretok_cuttable}")
    template = render_template(MODEL_DIR)
    builder = ChatBuilder()
    messages, prompt, n_ref = build_chat(tok, template, builder)
    print(f"chat: {len(messages)} messages, {len(prompt):,} chars, {len(prompt.encode()):,} bytes, {n_ref:,} tokens")
    t = time.perf_counter()
    assert len(tok.encode(prompt).ids) == n_ref
    print(f"single-pass Tokenizer.encode: {time.perf_counter() - t:.2f}s (holds the GIL throughout)")
    small = [builder.message_text(random.Random(i).randrange(200, 6_000)) for i in range(64)]
    print(f"concurrent small requests: {SMALL_RPS}/s, 50-1,500 tokens each, unique (cache misses), 7 tenants")

    exact = True
    lags: list[float] = []
    seen_all: list[tuple[str, int]] = []
    counter = cold_counter(mt)
    t = time.perf_counter()
    exact &= await counter.count(prompt, tenant="quiet") == n_ref
    print(f"cold, no other traffic: {time.perf_counter() - t:.3f}s")
    counter.close()
    colds: list[float] = []
    for run in range(3):
        counter = cold_counter(mt)
        n, wall, lag, seen = await measure(counter, prompt, small)
        exact &= n == n_ref
        colds.append(wall)
        lags += lag
        seen_all += seen
        print(
            f"cold run {run}: {n:,} tokens in {wall:.3f}s ({n / wall / 1e6:.2f} M tok/s), "
            f"{len(seen)} small requests, lag p99 {p99(lag):.2f} ms"
        )
        if run < 2:
            counter.close()
    warms: list[float] = []
    history = messages
    for run in range(3):
        msg = new_message(tok, builder)
        history = [*history, {"role": "assistant", "content": f"Noted ({run})."}, {"role": "user", "content": msg}]
        warm_prompt = render(template, history)
        n, wall, lag, seen = await measure(counter, warm_prompt, small)
        exact &= n == len(tok.encode(warm_prompt).ids)
        warms.append(wall)
        lags += lag
        seen_all += seen
        print(
            f"warm run {run}: +{len(tok.encode(msg).ids):,}-token message, {n:,} tokens in {wall * 1000:.1f} ms, "
            f"lag p99 {p99(lag):.2f} ms"
        )
    print(f"cache: {counter.cache_stats}")
    counter.close()
    one_message = render(template, [{"role": "user", "content": "\n\n".join(m["content"] for m in messages)}])
    counter = cold_counter(mt)
    t = time.perf_counter()
    n = await counter.count(one_message, tenant="bench")
    wall = time.perf_counter() - t
    one_ref = len(tok.encode(one_message).ids)
    exact &= n == one_ref
    print(f"cold, the whole chat as ONE message (cut at pre-tokenizer splits): {n:,} tokens in {wall:.3f}s")
    counter.close()
    counter = TokenCounter(mt)
    t = time.perf_counter()
    over = await counter.count(prompt, tenant="bench", limit=200_000)
    print(f"early exit: limit 200,000 -> returned {over:,} in {time.perf_counter() - t:.3f}s")
    counter.close()
    exact &= over > 200_000
    mismatched = sum(1 for text, n in seen_all if n != len(tok.encode(text).ids))
    exact &= mismatched == 0
    print(f"small requests checked against encode: {len(seen_all)}, {mismatched} mismatches; lag samples {len(lags)}")
    print(f"cold_1m_s={max(colds):.3f}")
    print(f"warm_1m_s={max(warms):.4f}")
    print(f"loop_lag_p99_ms={p99(lags):.2f}")
    print(f"exact={'yes' if exact else 'no'}")


def adversarial_texts(chars: int) -> dict[str, str]:
    """Texts of about `chars` characters built to make counting hold the GIL."""
    ideographs = "".join(chr(0x4E00 + i * 7919 % 20_000) for i in range(4096))  # CJK, no punctuation
    texts = {
        "one_char": "a" * chars,
        "token_start_char": "<" * chars,  # every position starts an added token's prefix
        "spaces": " " * chars,  # beyond ~10M in a row the tokenizer itself fails (Oniguruma retry limit)
        "newlines": "\n" * chars,
        "1M_space_messages": ("x" + " " * 2**20 + "y\n") * max(1, chars >> 20),
        "added_token": "<|user|>" * (chars // 8),
        "token_prefixes": "<|" * (chars // 2),
        "punctuation": "!" * chars,
        "punctuation_mix": ".,;:!?" * (chars // 6),
        "cjk_no_punct": (ideographs * (chars // len(ideographs) + 1))[:chars],
    }
    texts["mixed"] = "".join(text[: chars // len(texts)] for text in texts.values())
    return texts


_OUTSIDE_HEARTBEAT = """
import sys, time
while True:
    t = time.perf_counter()
    time.sleep(0.001)
    lag = (time.perf_counter() - t - 0.001) * 1000
    if lag > 1:
        print(f"{time.time():.4f} {lag:.2f}", flush=True)
"""


class OutsideProbe:
    """A 1 ms heartbeat in a process of its own, logging to a file: the lag this shared machine imposes on any
    process (CPU contention, VM stalls), to tell its stalls from the GIL's."""

    def __init__(self) -> None:
        self._log = tempfile.TemporaryFile("w+")
        self._proc = subprocess.Popen([sys.executable, "-c", _OUTSIDE_HEARTBEAT], stdout=self._log)

    def max_lag(self, since: float) -> float:
        """The largest lag (ms) seen since `since` (time.time())."""
        self._log.seek(0)
        lags = (line.split() for line in self._log.read().splitlines())
        return max((float(lag) for t, lag in lags if float(t) >= since), default=0.0)

    def close(self) -> None:
        self._proc.kill()
        self._proc.wait()
        self._log.close()


@dataclass
class LagRun:
    results: list[int | str]  # counts, or why a text is unencodable
    wall: float
    lags: list[float]  # ms, in this process's event loop
    outside_max: float  # ms, in a heartbeat process of its own meanwhile

    def line(self, name: str, chars: int) -> str:
        counted = ", ".join(f"{r:,} tokens" if isinstance(r, int) else r for r in self.results) or "nothing"
        lag = f"lag p99 {p99(self.lags):.2f} ms, max {max(self.lags):.2f} ms"
        outside = f"(outside: {self.outside_max:.0f})"
        return f"{name}: {chars / 1e6:.1f}M chars, {counted} in {self.wall:.1f}s; {lag} {outside}"


async def lag_while_counting(counter: TokenCounter, texts: list[str], outside: OutsideProbe) -> LagRun:
    """Counts and heartbeat lags while `texts` are counted at once."""
    probe = LagProbe()
    task = asyncio.create_task(probe.run())
    await asyncio.sleep(0.05)
    since, t = time.time(), time.perf_counter()
    results = await asyncio.gather(
        *(counter.count(text, tenant=f"adv-{i}") for i, text in enumerate(texts)), return_exceptions=True
    )
    wall = time.perf_counter() - t
    probe.stop()
    await task
    out: list[int | str] = []
    for r in results:
        if isinstance(r, UnencodableText):
            out.append(f"unencodable ({str(r)[:60]})")
        elif isinstance(r, BaseException):
            raise r
        else:
            out.append(r)
    return LagRun(out, wall, probe.samples, outside.max_lag(since))


async def adversarial(million_chars: float, check: bool) -> None:
    mt = ModelTokenizer.load(MODEL_DIR / "tokenizer.json.gz")
    chars = int(million_chars * 1e6)
    texts = adversarial_texts(chars)
    print(f"adversarial texts of {chars:,} characters, counted with a 1 ms heartbeat on the event loop "
          "((outside: N): the max lag in ms of a heartbeat process of its own meanwhile)")
    outside = OutsideProbe()
    probe = LagProbe()
    since = time.time()
    task = asyncio.create_task(probe.run())
    await asyncio.sleep(IDLE_S)
    probe.stop()
    await task
    idle = LagRun([], IDLE_S, probe.samples, outside.max_lag(since))
    print(idle.line("idle, nothing counted", 0))
    counter = TokenCounter(mt)
    # The first text too long to count in-process starts the helper process (~1 s, once per process).
    print((await lag_while_counting(counter, ["a" * 2**22], outside)).line("helper process start (4M chars)", 2**22))
    all_lags: list[float] = []
    mismatches = 0
    for name, text in texts.items():
        run = await lag_while_counting(counter, [text], outside)
        all_lags += run.lags
        print(run.line(name, len(text)), flush=True)
        if check:
            ref = await asyncio.to_thread(lambda text=text: len(mt.tokenizer.encode_batch_fast([text])[0]))
            mismatches += run.results[0] != ref
    several = [texts[k][: chars // 4] for k in ("one_char", "added_token", "cjk_no_punct", "mixed")]
    run = await lag_while_counting(counter, several, outside)
    all_lags += run.lags
    print(run.line("4 at once (one_char, added_token, cjk_no_punct, mixed)", sum(map(len, several))))
    counter.close()
    outside.close()
    if check:
        print(f"adversarial_mismatches={mismatches}")
    print(f"adversarial_lag_p99_ms={p99(all_lags):.2f}")
    print(f"adversarial_lag_max_ms={max(all_lags):.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lag", type=float, nargs="?", const=64.0, metavar="MB", help="adversarial lag scenario")
    parser.add_argument("--check", action="store_true", help="with --lag: compare counts with single-pass encode")
    args = parser.parse_args()
    asyncio.run(main() if args.lag is None else adversarial(args.lag, args.check))
