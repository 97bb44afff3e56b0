"""`--kv-events-config` and SGLang's `ZmqEventPublisher` (`disaggregation/kv_events.py`), with test hooks.

The publisher thread owns both sockets: the emulator loop only queues batches. Each batch gets the next sequence
number (from 0 per process), is encoded with msgspec's msgpack encoder and sent on the PUB socket as
`(topic, seq as 8 big-endian bytes, payload)`, and is kept in a replay buffer of `buffer_steps` batches. A DEALER
sending `(b"", start_seq as 8 big-endian bytes)` to the ROUTER at `replay_endpoint` gets every buffered batch with
`seq >= start_seq`, then an end marker with seq -1:
  before 0.5.22: `(b"", seq, payload)` ... `(b"", -1, b"")`
  0.5.22+:       `(b"", topic, seq, payload)` ... `(b"", b"", -1, b"")` (the same frames as live events)

Hooks (`/emu/kv_events`): `pause` drops batches before they get a sequence number (a publisher that went silent);
`drop_next` numbers and buffers the next batches but does not send them (a gap the subscriber must replay);
`malformed_next` sends the next batches with a payload that is not msgpack, under their own sequence numbers (the
replay buffer keeps the real payload).
"""

from __future__ import annotations

import json
import queue
import threading
from collections import deque
from dataclasses import dataclass
from itertools import count
from typing import Any

from .dialect import Dialect

END_SEQ = (-1).to_bytes(8, "big", signed=True)
GARBAGE = b"\xc1 not msgpack"  # 0xc1 is the one byte msgpack never uses: no decoder accepts this payload
_POLL_S = 0.05  # how often an idle publisher thread looks at the replay socket


@dataclass(frozen=True)
class KvEventsConfig:
    """`KVEventsConfig` (pydantic in SGLang: unknown keys are ignored, omitted ones take these defaults)."""

    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    bind: bool | None = None  # 0.5.22+: bind or connect the PUB socket; None = guess from the endpoint
    format: str = "default"  # 0.5.22+: "dynamo" (namespaced hashes) is not emulated

    @classmethod
    def parse(cls, raw: str, dialect: Dialect) -> KvEventsConfig:
        """`KVEventsConfig.from_cli`; raises ValueError."""
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        modern = dialect is not Dialect.V0_5_8
        fields: dict[str, Any] = {}
        for name, kind in (("publisher", str), ("endpoint", str), ("replay_endpoint", (str, type(None))),
                           ("buffer_steps", int), ("hwm", int), ("max_queue_size", int), ("topic", str)):
            if name in data:
                if not isinstance(data[name], kind) or isinstance(data[name], bool):
                    raise ValueError(f"--kv-events-config: bad {name}: {data[name]!r}")
                fields[name] = data[name]
        if modern and "bind" in data:
            if not isinstance(data["bind"], (bool, type(None))):
                raise ValueError(f"--kv-events-config: bad bind: {data['bind']!r}")
            fields["bind"] = data["bind"]
        if modern and "format" in data:
            if data["format"] not in ("default", "dynamo"):
                raise ValueError(f"--kv-events-config: bad format: {data['format']!r}")
            if data["format"] == "dynamo":
                raise ValueError("--kv-events-config: the dynamo format is not emulated")
            fields["format"] = data["format"]
        cfg = cls(**fields)
        if cfg.publisher not in ("null", "zmq"):
            raise ValueError(f"Unknown event publisher '{cfg.publisher}'")
        return cfg

    def binds(self, dialect: Dialect) -> bool:
        """`_socket_setup`'s heuristic: bind a wildcard, IPC or inproc address, connect anything else."""
        if dialect is not Dialect.V0_5_8 and self.bind is not None:
            return self.bind
        ep = self.endpoint
        wildcard = "*" in ep or "::" in ep or (dialect is not Dialect.V0_5_8 and "0.0.0.0" in ep)
        return wildcard or ep.startswith("ipc://") or ep.startswith("inproc://")


class ZmqEventPublisher:
    def __init__(self, cfg: KvEventsConfig, dialect: Dialect) -> None:
        import msgspec
        import zmq

        self._zmq = zmq
        self._encoder = msgspec.msgpack.Encoder()
        self._modern = dialect is not Dialect.V0_5_8
        self._topic = cfg.topic.encode("utf-8")
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue(maxsize=cfg.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._seq = count()
        self.paused = False
        self.drop_next = 0  # owned by the thread once started (set through control())
        self.malformed_next = 0
        self.sent = 0
        self._ctx = zmq.Context()  # the engine's own: a fork server's process never made one
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(cfg.hwm)
            if cfg.binds(dialect):
                self._pub.bind(cfg.endpoint)
            else:
                self._pub.connect(cfg.endpoint)
            if cfg.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(cfg.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise OSError(f"kv events endpoint {cfg.endpoint} / {cfg.replay_endpoint}: {str(e).lower()}") from None
        self._thread = threading.Thread(target=self._run, daemon=True, name="zmq-publisher")
        self._thread.start()

    # loop side
    def publish(self, batch: Any) -> None:
        if self.paused:
            return  # a silent publisher: no sequence number, nothing to replay
        try:
            self._queue.put_nowait(("batch", batch))
        except queue.Full:
            pass  # SGLang's publish() would block the scheduler here; the emulator drops the batch instead

    def control(self, drop_next: int | None = None, malformed_next: int | None = None) -> None:
        """Applies to the batches queued after this call."""
        self._queue.put(("control", (drop_next, malformed_next)))

    def state(self) -> dict[str, Any]:
        return {"paused": self.paused, "next_seq": self.sent, "drop_next": self.drop_next,
                "malformed_next": self.malformed_next, "buffered": len(self._buffer)}

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2.0)

    # the publisher thread
    def _run(self) -> None:
        try:
            while True:
                while self._replay is not None and self._replay.poll(0):
                    self._service_replay()
                try:
                    item = self._queue.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                if item is None:
                    return
                kind, value = item
                if kind == "control":
                    drop, malformed = value
                    if drop is not None:
                        self.drop_next = drop
                    if malformed is not None:
                        self.malformed_next = malformed
                    continue
                self._send(value)
        finally:
            self._close_sockets()

    def _send(self, batch: Any) -> None:
        seq = next(self._seq)
        payload = self._encoder.encode(batch)
        self._buffer.append((seq, payload))
        self.sent = seq + 1
        if self.drop_next > 0:
            self.drop_next -= 1
            return
        if self.malformed_next > 0:
            self.malformed_next -= 1
            payload = GARBAGE
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))

    def _service_replay(self) -> None:
        assert self._replay is not None
        frame = self._replay.recv_multipart()
        if len(frame) != 3:  # "Invalid replay request": ignored
            return
        client, _, start_bytes = frame
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                if self._modern:
                    self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
                else:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        if self._modern:
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
        else:
            self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
