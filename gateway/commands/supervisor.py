"""`kvgate serve`: one gateway process, or (`--workers N`) a supervisor of N on one port."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from types import FrameType

from gateway.config import GatewayConfig, load_config
from gateway.http.server import serve_one
from gateway.parent_death import die_with_parent


def serve(config: GatewayConfig, *, log_level: str, config_path: str | None = None, workers: int = 1) -> int:
    """Run the gateway until it is stopped; 3 when it could not start (e.g. a model refused by the KV-pool gate,
    printed as one block per model). `workers` > 1: that many processes on one port (see `serve_processes`)."""
    if workers > 1:
        return serve_processes(config, log_level=log_level, config_path=config_path, workers=workers)
    return serve_one(config, log_level=log_level, config_path=config_path)


def serve_processes(config: GatewayConfig, *, log_level: str, config_path: str | None, workers: int) -> int:
    """`workers` gateway processes on one port, so one machine's cores are all used: this process binds the listening
    socket and forks the workers, which all accept on it (the kernel spreads connections). SIGTERM, SIGINT and SIGHUP
    are passed on to every worker; a worker that dies unbidden is started again. With `state.backend: redis` the
    workers act as one gateway; with `memory` each keeps its own limits, load and kill switches."""
    sock = _listening_socket(config.listen.host, config.listen.port)
    parent = os.getpid()
    children: dict[int, int] = {}  # pid → worker index
    stopping = False

    def start(index: int) -> None:
        # Signals wait until the child has its own handlers (else `forward` could run in the child).
        signal.pthread_sigmask(signal.SIG_BLOCK, _FORWARDED)
        pid = os.fork()
        if pid == 0:  # the worker: default signal handling, its own event loop
            # Its own process group: a terminal's Ctrl-C (SIGINT to the foreground group) reaches the parent alone,
            # which passes it on once. Twice, the second would end the worker's drain at once.
            os.setpgid(0, 0)
            die_with_parent(parent)  # which no longer reaches it through the group: a SIGKILLed parent, too
            for sig in _FORWARDED:
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)
            code = 1
            try:
                # The file as it is now: a worker started again follows the reloads its siblings followed.
                current = load_config(config_path) if config_path else config
                code = serve_one(current, log_level=log_level, config_path=config_path, sock=sock)
            finally:
                os._exit(code)
        children[pid] = index
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)

    def forward(sig: int, _: FrameType | None) -> None:
        nonlocal stopping
        stopping = stopping or sig != signal.SIGHUP
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    for index in range(workers):
        start(index)
    worst = 0  # the exit code: the worst of the workers' last exits (a crash that was restarted does not count)
    while children:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        ended = children.pop(pid, -1)  # -1: not one of the workers
        code = os.waitstatus_to_exitcode(status)
        if ended >= 0 and not stopping and code not in (0, 3):
            print(f"kvgate: worker {ended} (pid {pid}) exited with {code}; starting it again", file=sys.stderr,
                  flush=True)
            time.sleep(1.0)
            if not stopping:  # a stop may have come during the pause
                start(ended)
                continue
        worst = max(worst, abs(code))
        if code == 3 and not stopping:  # refused to start (e.g. the KV-pool gate): the others would too
            forward(signal.SIGTERM, None)
    sock.close()
    return worst


_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
