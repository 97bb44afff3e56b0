"""Count huge uncuttable texts in a helper process, so that their cost never lands on the gateway's GIL.

`encode_batch_fast` releases the GIL while it encodes, but not while it converts its input to UTF-8 (~1 ns a
byte) nor while its result is freed (~6 ns a token): one 64 MB text without a verified cut (a run of one
letter, CJK without punctuation) would stall the event loop for hundreds of ms, and its encoding can take
tens of GB. The helper pays for both, under a memory cap; the gateway only hands it the text in UTF-8 slices.
Started on first use, it counts one text at a time.
"""

from __future__ import annotations

import logging
import os
import resource
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO

from gateway.admission.gil import YIELD_CHARS, pace
from gateway.admission.parallel_count import EncodeFailed, encode_lengths
from gateway.admission.tokenizer import ModelTokenizer

log = logging.getLogger(__name__)
_HEADER = struct.Struct(">q")
_MEMORY_SHARE = 0.5  # of physical memory, the helper's address-space cap: it fails alone rather than starve us


class IsolatedCounter:
    def __init__(self, tokenizer_json: bytes) -> None:
        self._json = tokenizer_json
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._closed = False

    def length(self, text: str, start: int, stop: int) -> int:
        """Token count of text[start:stop] (add_special_tokens=False); raises EncodeFailed."""
        with self._lock:
            try:
                proc = self._started()
                # Slice by slice: one `encode` of it all, or freeing all the slices at once, holds the GIL.
                for i in range(start, stop, YIELD_CHARS):
                    _send(proc, text[i : min(i + YIELD_CHARS, stop)].encode())
                    pace()
                _send(proc, b"")  # end of text
                n = _read_int(proc)
                if n < 0:
                    raise EncodeFailed(_read_exactly(proc, -n).decode())
                return n
            except UnicodeEncodeError as exc:  # the helper holds part of a text: start a new one next time
                self._stop()
                raise EncodeFailed(str(exc)) from exc
            except OSError as exc:  # the helper died (out of memory?)
                self._stop()
                log.warning("the tokenizer helper process failed: %s", exc)  # a path, an errno: not the client's
                raise EncodeFailed("the tokenizer process failed") from exc

    def __enter__(self) -> IsolatedCounter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        if (proc := self._proc) is not None:
            proc.kill()  # ends a count in flight at once: its thread sees the pipe close and cleans up
        with self._lock:
            self._stop()

    def _started(self) -> subprocess.Popen[bytes]:
        if self._closed:
            raise EncodeFailed("the token counter is closed")
        if self._proc is None:
            root = str(Path(__file__).resolve().parents[2])
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
            self._proc = subprocess.Popen(
                [sys.executable, "-m", __name__],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,  # a panic's backtrace; the reply carries the message
                env=env,
            )
            _send(self._proc, self._json)
        return self._proc

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None:
                    pipe.close()
            self._proc = None


def _send(proc: subprocess.Popen[bytes], data: bytes) -> None:
    """One frame: its length, then its bytes (each os.write releases the GIL)."""
    assert proc.stdin is not None
    fd = proc.stdin.fileno()
    _write_all(fd, _HEADER.pack(len(data)))
    _write_all(fd, data)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_int(proc: subprocess.Popen[bytes]) -> int:
    return int(_HEADER.unpack(_read_exactly(proc, _HEADER.size))[0])


def _read_exactly(proc: subprocess.Popen[bytes], n: int) -> bytes:
    assert proc.stdout is not None
    data = proc.stdout.read(n)
    if len(data) < n:
        raise BrokenPipeError(f"exit code {proc.wait()}")
    return data


def _serve() -> None:
    """The helper: read the tokenizer, then count each text (frames up to an empty one) and answer its count,
    or -len(message) and the message."""
    cap = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * _MEMORY_SHARE)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    tokenizer = ModelTokenizer(_frame(stdin)).tokenizer
    while True:
        try:
            text = b"".join(iter(lambda: _frame(stdin), b"")).decode()
        except EOFError:
            return
        try:
            reply = _HEADER.pack(encode_lengths(tokenizer, [text])[0])
        except (EncodeFailed, MemoryError) as exc:
            message = (str(exc) or type(exc).__name__).encode()
            reply = _HEADER.pack(-len(message)) + message
        del text  # before waiting for the next one
        stdout.write(reply)
        stdout.flush()


def _exit_with_parent(parent: int) -> None:
    """A count can take a minute and GBs: end it when the parent dies, not when it ends (encoding frees the GIL)."""
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)


def _frame(stream: BinaryIO) -> bytes:
    n = _HEADER.unpack(_read_stream(stream, _HEADER.size))[0]
    return _read_stream(stream, n)


def _read_stream(stream: BinaryIO, n: int) -> bytes:
    data = stream.read(n)
    if len(data) < n:
        raise EOFError
    return data


if __name__ == "__main__":
    _serve()
