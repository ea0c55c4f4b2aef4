"""The messages between the HTTP process and the engine-core process, and their framing.

Both ends of one stream socket (a `socket.socketpair`) carry frames: a 4-byte big-endian
length, then a pickle of plain data (tuples, lists, dicts, ints, floats, strings). Each end
reads with `FrameReader` (bytes in, whole messages out) and writes through an `Outbox`
that never blocks: what the socket does not take now stays queued for the next `flush`.

HTTP process -> engine core:
  ("add", [(rid, prompt ids, SamplingParams fields as a dict, seed stream or None), ...])
  ("abort", [rid, ...])          end these requests now (their KV pages go back)
  ("shutdown", grace_s)          live requests may finish for grace_s seconds, then are aborted
  ("exit",)                      abort everything and end the process

Engine core -> HTTP process:
  ("ready", info)                once, when the Engine is built: `info` holds the Engine's
                                 limits (`serving.limits.EngineLimits` fields), the process id and
                                 what the engine factory reported (stop ids, tokenizer dir)
  ("failed", message, kind, tb)  the Engine could not be built (then the process ends); kind
                                 "user" (a bad flag or checkpoint: one line) or "internal"
                                 (tb: its traceback)
  ("out", outputs, state)        outputs: [(rid, new token ids, finish reason or None), ...]
                                 since the last message (several steps when the socket was
                                 backed up); state: the engine state dict for /metrics and
                                 /health (`metrics.EngineState` fields), or None
  ("log", level, text)           a record for the server's log (a failed step's traceback)
"""

from __future__ import annotations

import pickle
import socket
from typing import Any

HEADER = 4
PROTOCOL = pickle.HIGHEST_PROTOCOL
SOCKET_BUFFER = 1 << 20
"""Bytes asked of the kernel for each direction's socket buffer (best effort)."""


class PeerGone(Exception):
    """The other process closed its end (it exited or crashed)."""


def _frame(message: Any) -> tuple[bytes, bytes]:
    """(header, body) of one frame: the pickle's length (HEADER bytes, big-endian), the pickle."""
    body = pickle.dumps(message, protocol=PROTOCOL)
    return len(body).to_bytes(HEADER, "big"), body


def encode(message: Any) -> bytes:
    header, body = _frame(message)
    return header + body


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """(HTTP end, engine-core end), with large buffers where the kernel allows."""
    a, b = socket.socketpair()
    for s in (a, b):
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                s.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
            except OSError:
                pass
    return a, b


class FrameReader:
    """Reads whole messages off a non-blocking socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()

    def read(self) -> list[Any]:
        """Every message that can be read now ([] when none); PeerGone at end of stream."""
        while True:
            try:
                chunk = self.sock.recv(SOCKET_BUFFER)
            except (BlockingIOError, InterruptedError):
                break
            except (ConnectionResetError, OSError) as e:
                raise PeerGone(str(e)) from None
            if not chunk:
                raise PeerGone("end of stream")
            self._buf += chunk
            if len(chunk) < SOCKET_BUFFER:
                break
        return self._messages()

    def _messages(self) -> list[Any]:
        out, buf, at = [], self._buf, 0
        while len(buf) - at >= HEADER:
            n = int.from_bytes(buf[at:at + HEADER], "big")
            if len(buf) - at - HEADER < n:
                break
            with memoryview(buf) as view:
                out.append(pickle.loads(view[at + HEADER:at + HEADER + n]))
            at += HEADER + n
        del buf[:at]
        return out


class Outbox:
    """Frames waiting to be written to a non-blocking socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()

    def __bool__(self) -> bool:
        return bool(self._buf)

    def put(self, message: Any) -> None:
        header, body = _frame(message)  # `encode`'s frame, copied into the buffer once
        self._buf += header
        self._buf += body

    def flush(self) -> bool:
        """Write what the socket takes now; True when nothing is left. PeerGone when the
        other end is closed."""
        while self._buf:
            try:
                sent = self.sock.send(self._buf)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as e:  # BrokenPipeError, ConnectionResetError
                raise PeerGone(str(e)) from None
            del self._buf[:sent]
        return True
