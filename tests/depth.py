"""How hard property tests search: a quick pass by default, the full search with KVGATE_TEST_DEPTH=full
(before a release, or after touching counting, chat rendering or cuts)."""

from __future__ import annotations

import os

FULL = os.environ.get("KVGATE_TEST_DEPTH", "") == "full"


def examples(full: int) -> int:
    """Hypothesis examples for a test whose full search is `full` examples."""
    return full if FULL else max(25, full // 4)
