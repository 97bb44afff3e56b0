"""The SGLang parity tier runs only under `bin/test --sglang` (KVGATE_SGLANG_PARITY=1): it builds, once, a venv per
SGLang version (loadtests/sglang_reference/build.py), and the default suite stays as fast as it is."""

import os

# test_sglang_engine.py: a real SGLang prefill/decode pair on the CPU behind kvgate (loadtests/sglang_reference/engine.py)
TIER = ["test_sglang_parity.py", "test_sglang_engine.py"]
collect_ignore = [] if os.environ.get("KVGATE_SGLANG_PARITY") == "1" else TIER
