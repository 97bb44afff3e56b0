"""A child process that must not outlive the gateway process that started it (admission workers, `--workers`)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel sends this process SIGTERM when its parent dies, however it dies (a SIGKILL included), so
    it drains and exits instead of being orphaned; elsewhere nothing."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(0)
