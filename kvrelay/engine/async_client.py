"""The API server's handle on the engine-core process on this machine: `AsyncEngine`, an
`EngineClient` (a `CoreClient`, `engine/core_client.py`, that owns the requests' streams).

It starts the core process and owns the pipe to it: messages go out in the codec of
`engine/codec.py`, and the event loop reads the pipe itself (`add_reader`, one wake-up per
engine step, one non-blocking recv into `FrameReader`; no reader thread).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import struct
import threading

from kvrelay.config import EngineArgs
from kvrelay.engine.client import EngineDeadError
from kvrelay.engine.codec import FROM_ENGINE, CodecError, encode
from kvrelay.engine.core_client import CoreClient
from kvrelay.engine.core_proc import run_engine_core
from kvrelay.engine.messages import Fatal, Shutdown, ToEngine

logger = logging.getLogger(__name__)


class FrameReader:
    """`multiprocessing.Connection`'s framing (a 4-byte big-endian length, or -1 and an
    8-byte one, then the payload), read without blocking from a socket whose descriptor
    stays blocking for the writer's sake: each `read` takes what is there in one recv(2)
    (MSG_DONTWAIT) and returns the payloads completed so far (None at end of file); a
    partial message waits for the next call."""

    # a larger buffer costs more than it saves: recv(1 MiB) of a 300-byte message took
    # 54 µs (the buffer is mapped and unmapped each call), recv(64 KiB) 7 µs; a bigger
    # message takes a few wake-ups (the loop polls level-triggered)
    CHUNK = 1 << 16

    def __init__(self, fd: int) -> None:
        self.sock = socket.socket(fileno=os.dup(fd))
        self.buffer = bytearray()

    def close(self) -> None:
        self.sock.close()

    def read(self) -> list[bytes | memoryview] | None:
        try:
            data = self.sock.recv(self.CHUNK, socket.MSG_DONTWAIT)
        except BlockingIOError:                  # woken spuriously: nothing there yet
            return []
        if not data:
            return None
        buf = self.buffer
        if not buf and len(data) >= 4:           # the common case: one whole message
            size = _HEADER.unpack_from(data)[0]
            if size >= 0 and len(data) == 4 + size:
                return [memoryview(data)[4:]]
        buf += data
        payloads: list[bytes | memoryview] = []
        start = 0
        while len(buf) - start >= 4:
            size, head = _HEADER.unpack_from(buf, start)[0], 4
            if size == -1:                       # a message over 2 GiB
                if len(buf) - start < 12:
                    break
                size, head = _LONG_HEADER.unpack_from(buf, start + 4)[0], 12
            if len(buf) - start < head + size:
                break
            payloads.append(bytes(buf[start + head:start + head + size]))
            start += head + size
        del buf[:start]
        return payloads


_HEADER, _LONG_HEADER = struct.Struct("!i"), struct.Struct("!Q")


class AsyncEngine(CoreClient):
    """An `EngineClient` for one engine-core process on this machine."""

    def __init__(self, args: EngineArgs, step_timeout_s: float | None = None) -> None:
        super().__init__(step_timeout_s)
        self.args = args
        self._send_lock = threading.Lock()
        self._frames: FrameReader | None = None
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=run_engine_core,
                                   args=(args, child, logging.getLogger().level),
                                   name="kvrelay-engine-core", daemon=False)
        self.launched = False

    def launch(self) -> None:
        """Start the engine-core process now (idempotent): its imports and weights then
        overlap the API server's own start-up instead of following it. Its first messages
        wait in the pipe until `start` reads them."""
        if not self.launched:
            self.process.start()
            self.launched = True

    def start(self) -> None:
        super().start()
        self.launch()
        assert self._loop is not None, "CoreClient.start set the running loop"
        fd = self._conn.fileno()
        self._frames = FrameReader(fd)
        self._loop.add_reader(fd, self._readable)
        # uvloop makes a descriptor it watches non-blocking; `_deliver`'s writes must block
        # (a burst of requests may outgrow the socket's buffer), the reader never does
        os.set_blocking(fd, True)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        if self.process.is_alive():
            try:
                self._send(Shutdown())
            except (OSError, EngineDeadError):
                pass
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()

    def _deliver(self, message: ToEngine) -> None:
        with self._send_lock:
            self._conn.send_bytes(encode(message))

    def _readable(self) -> None:
        """The pipe has data: read what is there and handle every whole message here, in
        the event loop.

        A reader thread would cost each step a thread wake-up, a GIL hand-over and a wake of
        the loop through its self-pipe: at one stream that was a third of the API process's
        CPU per token, and on shared cores CPU taken from the engine's compute threads. One
        recv(2) per wake-up (Connection.recv makes two reads, and the descriptor's blocking
        mode had to be checked first); the read never blocks, so a message larger than the
        socket's buffer arrives over several wake-ups without holding up the loop."""
        assert self._loop is not None and self._frames is not None
        try:
            messages = self._frames.read()
        except OSError:
            messages = None
        for payload in messages or ():
            try:
                message = FROM_ENGINE.decode(payload)
            except CodecError as e:
                message = Fatal(f"the engine process sent no engine message: {e}")
            if isinstance(message, Fatal):
                self._stop_reading()
                self._dispatch(message)
                return
            self._dispatch(message)
        if messages is None:                      # end of file: the core is gone
            self._stop_reading()
            self._dispatch(Fatal("the engine process exited"))

    def _stop_reading(self) -> None:
        assert self._loop is not None and self._frames is not None
        self._loop.remove_reader(self._conn.fileno())
        self._frames.close()

    def _exit_was_asked(self) -> bool:
        return self._stopping or self._terminated()

    def _exit_detail(self) -> str:
        return f" (exit code {self.process.exitcode})"

    def _terminated(self) -> bool:
        """Did the core exit on SIGTERM/SIGINT (e.g. sent to the whole process group by a
        supervisor stopping the server)? Called only once its pipe has closed."""
        self.process.join(1.0)
        return self.process.exitcode in (-signal.SIGTERM, -signal.SIGINT)
