"""Which SGLang release's request handling the emulator follows, derived from the version it reports (`--version`).

Versions before 0.5.22 behave as 0.5.8, any 0.5.22.x as 0.5.22, and 0.5.23 or later as 0.5.23.
"""

from __future__ import annotations

import re
from enum import IntEnum


class Dialect(IntEnum):
    V0_5_8 = 0
    V0_5_22 = 1
    V0_5_23 = 2


_RELEASE = re.compile(r"v?(\d+)(?:\.(\d+))?(?:\.(\d+))?")


def dialect_of(version: str) -> Dialect:
    """`0.5.8`, `0.5.22.post1`, `v0.5.23rc0`, `0.6.0` ... -> the dialect; raises ValueError for a non-version."""
    m = _RELEASE.match(version.strip())
    if m is None:
        raise ValueError(f"not an SGLang version: {version!r}")
    release = tuple(int(part or 0) for part in m.groups())
    if release >= (0, 5, 23):
        return Dialect.V0_5_23
    if release >= (0, 5, 22):
        return Dialect.V0_5_22
    return Dialect.V0_5_8
