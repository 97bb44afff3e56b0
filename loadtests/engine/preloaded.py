"""Imported once by the harness's fork server (see `forked.py`): everything an engine loads before its ready line.

Engines forked afterwards find the modules imported and the default tokenizer parsed. Nothing here may raise: the
fork server ignores a failed preload only for ImportError, so any other failure is reported and engines then load
what they need themselves.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read by huggingface_hub when transformers is imported
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

try:
    import uvloop  # noqa: F401  (imported for the engines forked from here)

    from . import app, cli, engine  # noqa: F401
    from .harness import DEFAULT_TOKENIZER
    from .tokenizer import preload

    preload(DEFAULT_TOKENIZER)
except Exception as exc:
    print(f"loadtests.engine.preloaded: nothing preloaded: {exc!r}", file=sys.stderr)
