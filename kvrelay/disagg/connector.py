"""The engine's side of disaggregated serving (the KV-connector seam's user).

Owner of: the transport (NIXL or TCP) with this engine's KV tensors registered once,
the side-channel listener (prefill), the peers handshaken so far (decode), and the
in-flight KV loads (decode) and held requests' lease deadlines (prefill).

    prefill (kv_producer)                         decode (kv_consumer)
    ─────────────────────                         ────────────────────
    run prompt, finish, hold blocks ─params─▶ proxy ─▶ admit: allocate, KVLoad
    side channel: handshake ◀──────────────────────── once per prefill engine:
        reply {spec, transport metadata}                compare compat hash
    transport: serve READs ◀─────────────────────────── start_read(descs, notify=req id)
    take_notifications → release held blocks          poll → finish_load → recompute
    lease expiry → release held blocks                  last prompt token, decode

Block maths (block size B, prompt length P, decode prefix hit of h tokens): decode
needs the KV of tokens [0, P-1) (it recomputes token P-1). Of group g it reads the
logical blocks [max(h/B, first_g), (P-2)//B] where first_g = 0 for full attention and
(P-1-W+1)//B for a sliding window W; the prefill keeps exactly those (it only
releases blocks below the window of its own last chunk).
"""
from __future__ import annotations

import base64
import collections
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvrelay import envs
from kvrelay.disagg.params import KVTransferConfig
from kvrelay.kv_cache.spec import KVCacheSpec

logger = logging.getLogger(__name__)

HANDSHAKE_VERSION = 1


class HandshakeError(RuntimeError):
    pass


@dataclass
class _Peer:
    engine_id: str
    spec: dict[str, Any]
    num_blocks: int
    tp_size: int


@dataclass
class _Load:
    request_id: str
    handle: Any
    started: float
    nbytes: int


@dataclass
class TransferStats:
    transfers: int = 0
    failed: int = 0
    bytes: int = 0
    seconds: float = 0.0
    handshakes: int = 0
    handshake_errors: int = 0
    transport_fallbacks: int = 0
    leases_expired: int = 0
    read_done_notices: int = 0
    explicit_frees: int = 0


@dataclass
class KVConnector:
    config: KVTransferConfig
    engine_id: str
    spec: KVCacheSpec
    kv_tensors: list[Any]
    tp_size: int = 1
    stats: TransferStats = field(default_factory=TransferStats)

    def __post_init__(self) -> None:
        from kvrelay.disagg.transport import make_transport
        # a TCP transport serves reads where the side channel listens (0.0.0.0 in the tutorial)
        bind = (envs.SIDE_CHANNEL_HOST.raw() or "127.0.0.1") if self.config.is_producer else "127.0.0.1"
        # UCX error mode "none": control traffic over shared memory, ~100x faster first read;
        # a vanished peer is still caught by the load timeout (kv_connector_extra_config.load_timeout_s)
        options = self.config.extra.get("backend_options") or {"UCX": {"ucx_error_handling_mode": "none"}}
        self.transport = make_transport(list(self.config.backends), agent_name=self.engine_id, host=bind,
                                        backend_options=options)
        if getattr(self.transport, "fallback_from", None):
            self.stats.transport_fallbacks += 1
        self.transport.register(self.kv_tensors)
        self.block_bytes = self.kv_tensors[0][0, 0].nbytes
        self.num_blocks = self.kv_tensors[0].shape[1]
        self.peers: dict[str, _Peer] = {}
        self.loads: dict[str, _Load] = {}
        self.leases: dict[str, float] = {}
        self.server = None
        self.advertised: tuple[str, int] | None = None
        self._released: collections.deque[str] = collections.deque()   # filled by the side channel thread
        self._notifier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvrelay-kv-release")
        if self.config.is_producer:
            self._listen()

    # -- prefill side -------------------------------------------------------------------
    def _listen(self) -> None:
        from kvrelay.disagg.side_channel import SideChannelServer, advertised_host
        host = envs.SIDE_CHANNEL_HOST.raw() or "127.0.0.1"
        port = envs.SIDE_CHANNEL_PORT.as_int() or 0
        self.server = SideChannelServer(host, port, self._handle)
        self.server.start()
        bound_host, bound_port = self.server.address
        self.advertised = (advertised_host(host), bound_port)
        logger.info("KV side channel listening on %s:%d (advertised %s:%d), transport %s",
                    bound_host, bound_port, *self.advertised, self.transport.name)

    def _handle(self, message: dict[str, Any]) -> dict[str, Any]:
        if message.get("type") == "release":          # decode needed none of the blocks
            request_id = message.get("request_id")
            if not isinstance(request_id, str):
                return {"ok": False, "error": "release needs a request_id string"}
            self._released.append(request_id)
            return {"ok": True}
        if message.get("type") != "handshake":
            return {"ok": False, "error": f"unknown message type {message.get('type')!r}"}
        if message.get("version") != HANDSHAKE_VERSION:
            return {"ok": False, "error": f"handshake version {message.get('version')} != {HANDSHAKE_VERSION}"}
        theirs = message.get("spec") or {}
        mismatch = _spec_differences(self.spec, theirs, "prefill", "decode")
        if mismatch:
            logger.error("refused a KV handshake from %s: incompatible KV cache (%s)",
                         message.get("engine_id"), "; ".join(mismatch))
            return {"ok": False, "error": "incompatible KV cache: " + "; ".join(mismatch)}
        return {"ok": True, "engine_id": self.engine_id, "spec": self.spec.__dict__, "tp_size": self.tp_size,
                "num_blocks": self.num_blocks, "transport": _encode(self.transport.metadata())}

    def hold(self, request_id: str) -> dict[str, Any]:
        self.leases[request_id] = time.monotonic() + self.config.lease_s
        host, port = self.advertised or ("127.0.0.1", 0)
        return {"remote_engine_id": self.engine_id, "remote_host": host, "remote_port": port,
                "remote_request_id": request_id, "tp_size": self.tp_size}

    def released(self, request_id: str) -> None:
        self.leases.pop(request_id, None)

    def read_done(self) -> list[str]:
        """Requests whose blocks a decode server finished reading."""
        done = []
        notices = [n.decode(errors="replace") for n in self.transport.take_notifications()]
        while self._released:
            notices.append(self._released.popleft())
        for request_id in notices:
            if request_id in self.leases:
                self.stats.read_done_notices += 1
                done.append(request_id)
        return done

    def expired(self) -> list[str]:
        now = time.monotonic()
        gone = [r for r, deadline in self.leases.items() if deadline <= now]
        self.stats.leases_expired += len(gone)
        return gone

    # -- decode side --------------------------------------------------------------------
    def peer(self, engine_id: str, host: str, port: int) -> _Peer:
        if engine_id in self.peers:
            return self.peers[engine_id]
        from kvrelay.disagg.side_channel import side_channel_call
        reply = side_channel_call(host, port, {"type": "handshake", "version": HANDSHAKE_VERSION,
                                               "engine_id": self.engine_id, "spec": self.spec.__dict__})
        self.stats.handshakes += 1
        if not reply.get("ok"):
            self.stats.handshake_errors += 1
            raise HandshakeError(f"prefill engine at {host}:{port} refused the handshake: {reply.get('error')}")
        mismatch = _spec_differences(self.spec, reply.get("spec") or {}, "decode", "prefill")
        if mismatch:
            self.stats.handshake_errors += 1
            raise HandshakeError("incompatible KV cache: " + "; ".join(mismatch))
        if reply.get("tp_size") != self.tp_size:
            self.stats.handshake_errors += 1
            raise HandshakeError(f"prefill tp_size {reply.get('tp_size')} != decode tp_size {self.tp_size} "
                                 f"(different TP sizes are not supported yet)")
        self.transport.add_peer(engine_id, _decode(reply["transport"]))
        peer = _Peer(engine_id, reply["spec"], int(reply["num_blocks"]), int(reply["tp_size"]))
        self.peers[engine_id] = peer
        logger.info("KV handshake with %s at %s:%d done (transport %s)", engine_id, host, port, self.transport.name)
        return peer

    def start_load(self, request_id: str, params: Any, local_tables: list[list[int]], groups: list[Any],
                   hit_tokens: int, prompt_len: int, block_size: int) -> None:
        from kvrelay.disagg.transport import ReadDesc
        peer = self.peer(params.remote_engine_id, params.remote_host, params.remote_port)
        remote_tables = params.remote_block_ids
        if len(remote_tables) != len(local_tables):
            raise HandshakeError(f"prefill sent {len(remote_tables)} block lists, decode has "
                                 f"{len(local_tables)} KV-cache groups")
        descs = []
        for g, group in enumerate(groups):
            for i in needed_blocks(group.window, hit_tokens, prompt_len, block_size):
                if i >= len(remote_tables[g]) or remote_tables[g][i] == 0:
                    raise HandshakeError(f"prefill did not keep block {i} of KV-cache group {g}")
                remote, local = remote_tables[g][i], local_tables[g][i]
                for tensor in range(group.num_layers):
                    for kv in (0, 1):
                        descs.append(ReadDesc(tensor, (kv * peer.num_blocks + remote) * self.block_bytes,
                                              (kv * self.num_blocks + local) * self.block_bytes, self.block_bytes))
        nbytes = sum(d.nbytes for d in descs)
        if descs:
            handle = self.transport.start_read(peer.engine_id, descs, params.remote_request_id.encode())
        else:          # our own prefix cache had it all: tell the prefill to free its copy
            handle = None
            self.release_remote(params)
        self.loads[request_id] = _Load(request_id, handle, time.monotonic(), nbytes)

    def release_remote(self, params: Any) -> None:
        """Ask the prefill (in the background) to free blocks we will not read."""
        from kvrelay.disagg.side_channel import side_channel_call

        def send() -> None:
            try:
                side_channel_call(params.remote_host, params.remote_port,
                                  {"type": "release", "request_id": params.remote_request_id}, timeout=5)
            except Exception as e:  # the prefill's lease frees them anyway
                logger.warning("could not ask %s:%s to free %s: %s", params.remote_host, params.remote_port,
                               params.remote_request_id, e)
        self._notifier.submit(send)

    def poll_loads(self) -> list[tuple[str, str | None]]:
        """Finished loads as (request id, error or None)."""
        from kvrelay.disagg.transport import TransferError
        finished = []
        now = time.monotonic()
        for request_id, load in list(self.loads.items()):
            try:
                state = "done" if load.handle is None else self.transport.poll(load.handle)
            except TransferError as e:
                state, error = "error", str(e)
            if state == "pending" and now - load.started > self.config.load_timeout_s:
                state, error = "error", f"timed out after {self.config.load_timeout_s:.0f}s"
            if state == "pending":
                continue
            if load.handle is not None:
                self.transport.release(load.handle)
            del self.loads[request_id]
            if state == "done":
                self.stats.transfers += 1
                self.stats.bytes += load.nbytes
                self.stats.seconds += now - load.started
                finished.append((request_id, None))
            else:
                self.stats.failed += 1
                finished.append((request_id, error))
        return finished

    def cancel(self, request_id: str, params: Any = None) -> None:
        """The request was aborted while loading: drop the read, free the prefill's blocks."""
        load = self.loads.pop(request_id, None)
        if load is not None and load.handle is not None:
            self.transport.release(load.handle)
        if load is not None and params is not None:
            self.release_remote(params)

    @property
    def busy(self) -> bool:
        return bool(self.loads or self.leases)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self._notifier.shutdown(wait=False)
        self.transport.close()


def needed_blocks(window: int | None, hit_tokens: int, prompt_len: int, block_size: int) -> range:
    """Logical blocks decode must pull for tokens [hit, P-1) (see the module docstring)."""
    if prompt_len <= 1:
        return range(0)
    first = 0 if window is None else max(prompt_len - 1 - window + 1, 0) // block_size
    last = (prompt_len - 2) // block_size
    return range(max(hit_tokens // block_size, first), last + 1)


def _spec_differences(mine: KVCacheSpec, theirs: dict[str, Any], me: str, them: str) -> list[str]:
    """What differs, phrased the same on both sides: "block_size: prefill 4, decode 8"."""
    fields = mine.__dict__

    def say(key: str, a: Any, b: Any) -> str:
        pair = {me: a, them: b}
        return f"{key}: prefill {pair['prefill']!r}, decode {pair['decode']!r}"

    diffs = [say(k, fields[k], theirs.get(k)) for k in fields if k != "model" and fields[k] != theirs.get(k)]
    if fields["model"].split(":")[-1] != str(theirs.get("model", "")).split(":")[-1]:
        diffs.insert(0, say("model config", fields["model"], theirs.get("model")))
    return diffs


def _encode(metadata: dict[str, Any]) -> dict[str, Any]:
    return {k: {"__b64__": base64.b64encode(v).decode()} if isinstance(v, bytes) else v for k, v in metadata.items()}


def _decode(metadata: dict[str, Any]) -> dict[str, Any]:
    return {k: base64.b64decode(v["__b64__"]) if isinstance(v, dict) and "__b64__" in v else v
            for k, v in metadata.items()}
