"""Engines forked from a warm process: the same engine as `python -m loadtests.engine`, without its startup cost.

Each engine spends ~2.5 s of CPU before its ready line, nearly all of it parsing the tokenizer and importing
transformers; a suite that starts a hundred engines on two cores spends minutes on that alone. The harness instead
asks `multiprocessing`'s fork server, which imported `loadtests.engine.preloaded` once (loading the default
tokenizer), to fork each engine. A forked engine is still a process of its own with its own ports, arguments and
ready line, stopped by SIGTERM like one started from the command line; only its start is cheaper.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
from multiprocessing.connection import Connection
from typing import IO

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(["loadtests.engine.preloaded"])


class ForkedEngineProcess:
    """What the harness uses of `subprocess.Popen`, for an engine forked by the fork server: its output on
    `stdout`/`stderr`, `poll`, `wait`, `send_signal`, `kill`, `communicate`, and the exit code in `returncode`
    (negative for a signal, as Popen reports it)."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str) -> None:
        self.args = argv
        out_read, out_write = _context.Pipe(duplex=False)
        err_read, err_write = _context.Pipe(duplex=False)
        # daemon: the harness's process terminates an engine it forgot to stop when it exits, instead of waiting
        self._process = _context.Process(target=_run_engine, args=(argv, env, cwd, out_write, err_write),
                                         name="kvgate-engine", daemon=True)
        try:
            self._process.start()
        finally:
            out_write.close()
            err_write.close()
        self.stdout: IO[str] = _text_reader(out_read)
        self.stderr: IO[str] = _text_reader(err_read)
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the exit, then the output not read yet (the engine is gone, so both reads end)."""
        self.wait(timeout)
        return self.stdout.read(), self.stderr.read()


def _text_reader(connection: Connection) -> IO[str]:
    reader = os.fdopen(os.dup(connection.fileno()), "r")
    connection.close()
    return reader


def _run_engine(argv: list[str], env: dict[str, str], cwd: str, stdout: Connection, stderr: Connection) -> None:
    """In the forked child: the caller's environment, directory and pipes, then the engine's own `main`."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.dup2(stdout.fileno(), 1)
    os.dup2(stderr.fileno(), 2)
    stdout.close()
    stderr.close()
    from .cli import main

    main(argv)
