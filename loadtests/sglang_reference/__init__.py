"""kvgate's prompt count checked against SGLang's own request code (issue 24), per supported SGLang version.

- `build`: one cached venv per version (`~/.cache/kvgate/sglang-<V>/`) and a configs-only GLM-5 model directory;
- `driver`: runs inside such a venv: SGLang's FastAPI app, OpenAI handlers, template manager and a real
  `TokenizerManager`, in process, up to the hand-off to the scheduler (what is stubbed and why: its docstring and
  `stubs/README.md`);
- `cases`: generated requests of every shape kvgate accepts; `reference`, `kvgate_side`: the three answers
  (SGLang, kvgate's admission, the emulator); `compare`: the rules and the listed differences, each with its reason.

Run by `bin/test --sglang` (tests/parity); never by the default suite.
"""
