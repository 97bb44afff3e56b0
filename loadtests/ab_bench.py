"""One change's cost per request, before against after: `python -m loadtests.ab_bench --before DIR [--after DIR]`.

This machine's speed drifts by a third between runs a minute apart (the router's own CPU per request does), so a
change worth a few percent is lost between two `loadtests.bench` runs. Here both checkouts serve the same emulated
PD pair, alternately, round after round (before, after, before, after, …), each `kvgate serve` process measured
over the same rows as `loadtests.bench` (non-streaming `/generate` and streamed chat at c=64): the drift falls on
both sides alike, and the medians show what the change did. The engines' CPU per request is measured beside it.

    git worktree add /tmp/before <commit>
    python -m loadtests.ab_bench --before /tmp/before            # after: this checkout

Final lines: `before_nonstream_cpu_ms_per_req=…`, `after_nonstream_cpu_ms_per_req=…`, `nonstream_change=…%` and the
same for `stream32` and the engines' `engines_nonstream`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from loadtests.bench import CONTEXT, Front, Load, _write_config, run_row, scenarios
from loadtests.engine.harness import start_pair
from loadtests.procstat import LAG_FILE_ENV, REPO_ROOT, stop_process, wait_ready

ROWS = ("generate16", "chat32_stream")
Figures = dict[str, float]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.ab_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="a checkout of the code before the change")
    parser.add_argument("--after", default=str(REPO_ROOT), help="a checkout after it (default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    sides = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    results: dict[str, list[Figures]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="kvgate-ab-") as temp, \
            start_pair(prefill_pool=1_200_000, decode_pool=1_200_000, context_length=CONTEXT, bug=False,
                       model="glm-5", version="0.5.23", token_delay_ms=1) as pair:
        config, port = _write_config(Path(temp), pair)
        load = Load(None, pair, "")  # type: ignore[arg-type]  # a session per row (run_row)
        for round_ in range(args.rounds):
            for side, checkout in sides.items():
                figures = _measure(checkout, config, port, load, Path(temp) / "lags.json")
                results[side].append(figures)
                print(f"round {round_ + 1} {side:<6} " + "  ".join(f"{k}={v:.3f}" for k, v in figures.items()),
                      flush=True)
    for key in results["before"][0]:
        before = statistics.median(f[key] for f in results["before"])
        after = statistics.median(f[key] for f in results["after"])
        print(f"before_{key}_cpu_ms_per_req={before:.3f}")
        print(f"after_{key}_cpu_ms_per_req={after:.3f}")
        print(f"{key}_change={100 * (after - before) / before:+.1f}%")
    return 0


def _measure(checkout: Path, config: Path, port: int, load: Load, lag_file: Path) -> Figures:
    """One `kvgate serve` from `checkout` over the shared engines: its CPU per request on each row."""
    env = {**os.environ, LAG_FILE_ENV: str(lag_file)}
    gateway = subprocess.Popen([sys.executable, "-m", "loadtests.bench", "--serve", str(config)], cwd=checkout,
                               env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, gateway, timeout_s=90)
        front = Front("kvgate", url, gateway.pid)
        plan = {s.name: s for s in scenarios(quick=True)}

        async def rows() -> Figures:
            figures: Figures = {}
            for name in ROWS:
                row = await run_row(load, plan[name], front)
                short = "nonstream" if name == "generate16" else "stream32"
                figures[short] = row.cpu_ms_per_req or 0.0
                if name == "generate16":
                    figures["engines_nonstream"] = row.engines_cpu_ms_per_req
            return figures

        return asyncio.run(rows())
    finally:
        stop_process(gateway)


if __name__ == "__main__":
    sys.exit(main())
