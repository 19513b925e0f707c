"""A producer (prefill-side) KV transport in its own process, for the disagg tests and
the transport benchmark: registers known tensors and serves its metadata and received
notifications on a real SideChannelServer until told to stop."""
from __future__ import annotations

import base64
import multiprocessing as mp
import os
import time
from contextlib import contextmanager

import torch

SHAPE = (2, 16, 2, 4, 8)          # [K/V, num_blocks, kv_heads, block_size, head_dim]
DTYPES = (torch.bfloat16, torch.float32)


def source_tensors(shape=SHAPE, dtypes=DTYPES) -> list[torch.Tensor]:
    """Deterministic, all-nonzero KV-like tensors (the same in every process)."""
    out = []
    for i, dt in enumerate(dtypes):
        g = torch.Generator().manual_seed(1234 + i)
        t = torch.randn(shape, generator=g) + 10.0 * (i + 1)     # never zero
        out.append(t.to(dt).contiguous())
    return out


def make(kind: str, name: str | None = None, options: dict | None = None):
    if kind == "tcp":
        from kvrelay.disagg.tcp import TcpTransport
        return TcpTransport("127.0.0.1", 0)
    from kvrelay.disagg.nixl import NixlTransport
    return NixlTransport(name, backends=["UCX"], backend_options=options)


def producer_main(kind: str, shape, dtypes, options, ready, stop) -> None:
    """Process entry: sends ("ok", (host, port)) or ("error", why) on the `ready` pipe,
    then serves until anything (or EOF: the parent died) arrives on the `stop` pipe."""
    from kvrelay.disagg.side_channel import SideChannelServer
    torch.set_num_threads(1)
    transport = server = None
    received: list[bytes] = []
    try:
        transport = make(kind, f"producer-{os.getpid()}", options)
        tensors = source_tensors(shape, dtypes)
        transport.register(tensors)
        transport.expect_reads(True)        # serve reads (NIXL: progress its UCX worker)

        def handler(msg: dict) -> dict:
            op = msg.get("op")
            if op == "metadata":
                return {"transport": transport.metadata()}
            if op == "notifications":
                received.extend(transport.take_notifications())
                out = [base64.b64encode(m).decode() for m in received]
                received.clear()
                return {"notifs": out}
            raise ValueError(f"unknown op {op!r}")

        server = SideChannelServer("127.0.0.1", 0, handler).start()
        ready.send(("ok", server.address))
        stop.poll(None)
    except BaseException as e:  # report instead of dying silently
        try:
            ready.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
    finally:
        if server is not None:
            server.close()
        if transport is not None:
            transport.close()


class Producer:
    """The producer process; `stop()` always ends it (terminate, then kill)."""

    def __init__(self, kind: str, shape=SHAPE, dtypes=DTYPES, options: dict | None = None,
                 timeout: float = 60.0) -> None:
        ctx = mp.get_context("spawn")
        # pipes, not mp.Event/Queue: a killed child must not be able to wedge the parent
        self._ready, ready_w = ctx.Pipe(duplex=False)
        stop_r, self._stop = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=producer_main, daemon=True,
                                args=(kind, shape, dtypes, options, ready_w, stop_r))
        self.proc.start()
        ready_w.close()
        stop_r.close()
        deadline = time.monotonic() + timeout
        status, value = "error", "no answer"
        while time.monotonic() < deadline:
            try:
                if self._ready.poll(0.1):
                    status, value = self._ready.recv()
                    break
            except (EOFError, OSError):
                break
            if not self.proc.is_alive():
                break
        if status != "ok":
            code = self.proc.exitcode
            self.stop()
            raise RuntimeError(f"{kind} producer did not start ({value}; exit code {code})")
        self.host, self.port = value

    def call(self, msg: dict) -> dict:
        from kvrelay.disagg.side_channel import side_channel_call
        return side_channel_call(self.host, self.port, msg)

    def notifications(self, want: bytes | None = None, timeout: float = 10.0) -> list[bytes]:
        """Notices received so far; with `want`, wait until it is among them."""
        got: list[bytes] = []
        deadline = time.monotonic() + timeout
        while True:
            got += [base64.b64decode(m) for m in self.call({"op": "notifications"})["notifs"]]
            if want is None or want in got or time.monotonic() > deadline:
                return got
            time.sleep(0.01)

    def stop(self) -> None:
        try:
            self._stop.send(None)
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self._stop.close()
        self._ready.close()


@contextmanager
def producer(kind: str, **kw):
    p = Producer(kind, **kw)
    try:
        yield p
    finally:
        p.stop()
