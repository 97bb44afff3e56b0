"""The exchange's timing helpers: the idle watchdog, and waiting for a half to stop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class IdleWatchdog:
    """Once armed, calls `on_idle` after `idle_s` without `touch()`. One timer per idle period, re-armed lazily,
    because re-arming a timer on every chunk would cost more than the relay itself."""

    def __init__(self, idle_s: float, on_idle: Callable[[], None]) -> None:
        self._idle_s = idle_s
        self._on_idle = on_idle
        self._loop = asyncio.get_running_loop()
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def touch(self) -> None:
        self._last = self._loop.time()

    def arm(self) -> None:
        """Idle time counts from now (again, after `pause`)."""
        self._last = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_at(self._last + self._idle_s, self._check)

    def pause(self) -> None:
        """No timeout until `arm()`."""
        self.stop()

    def _check(self) -> None:
        deadline = self._last + self._idle_s
        if self._loop.time() < deadline:
            self._timer = self._loop.call_at(deadline, self._check)
            return
        self._timer = None
        self._on_idle()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self) -> None:
        """Stopped for good: the callback (its owner's bound method, a reference cycle) is let go."""
        self.stop()
        self._on_idle = _never


def _never() -> None:
    pass


async def parked() -> None:
    """Wait until cancelled."""
    await asyncio.get_running_loop().create_future()


async def stop(task: asyncio.Task[None] | None) -> None:
    """Cancel a half and wait until it has closed its connection."""
    if task is None or task is asyncio.current_task():
        return
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
