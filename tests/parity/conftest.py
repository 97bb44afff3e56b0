"""The SGLang parity tier runs only under `bin/test --sglang` (KVGATE_SGLANG_PARITY=1): it builds, once, a venv per
SGLang version (loadtests/sglang_reference/build.py), and the default suite stays as fast as it is."""

import os

collect_ignore = [] if os.environ.get("KVGATE_SGLANG_PARITY") == "1" else ["test_sglang_parity.py"]
