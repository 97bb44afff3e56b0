"""Marking the gateway's own canary traffic. The header carries a secret drawn when the process starts, so a client
cannot dress its requests up as probes (and so keep them out of the provenance check)."""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Sequence

PROBE_HEADER = "x-kvgate-probe"
PROBE_TOKEN = secrets.token_hex(16)
_PROBE_NAME = PROBE_HEADER.encode()


def is_probe(headers: Sequence[tuple[bytes, bytes]]) -> bool:
    sent = next((value for name, value in headers if name == _PROBE_NAME), None)
    return sent is not None and hmac.compare_digest(sent, PROBE_TOKEN.encode())
