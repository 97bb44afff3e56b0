"""Ask SGLang's own code (the driver, in its version's venv) for each request's prompt ids or its refusal."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from typing import Any

from . import build


@dataclass(frozen=True, slots=True)
class Answer:
    status: int                  # 200: served (ids are what the scheduler would get); else SGLang's own status
    ids: list[int] | None = None
    error: str | None = None


def sglang_answers(version: str, cases: list[dict[str, Any]], *, timeout_s: float = 900) -> dict[str, Answer]:
    """One driver process for the whole batch (it starts in about 10 s)."""
    py = build.build(version)
    model = build.model_dir()
    payload = "".join(json.dumps(c) + "\n" for c in cases)
    proc = subprocess.run([str(py), str(build.HERE / "driver.py"), str(model)], input=payload, text=True,
                          capture_output=True, env=build.driver_env(), timeout=timeout_s, check=False)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines or lines[0].get("ready") != version:
        raise RuntimeError(f"SGLang {version} driver did not start (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    answers = {str(d["id"]): Answer(d["status"], d.get("ids"), d.get("error")) for d in lines[1:]}
    missing = [c["id"] for c in cases if str(c["id"]) not in answers]
    if missing:
        raise RuntimeError(f"SGLang {version} driver stopped before {missing[:5]}…:\n{proc.stderr[-4000:]}")
    return answers
