"""The engine's side of disaggregated serving (the KV-connector seam's user).

Owner of: the side-channel listener (prefill), the peers handshaken so far (decode), the
in-flight KV loads and their per-rank completion (decode), the held requests (prefill,
through its `HeldRequests`: grants, leases, read-done counts), and rank 0's `KVWorker`.
Ranks 1..N-1 have their own `KVWorker` (kvrelay/disagg/worker.py); this class sends them
`KVWork` through the engine (`take_work`, shipped with the next step) and hears back
through `RankLink.kv_events`.

    prefill (kv_producer, TP a)                   decode (kv_consumer, TP b = m·a)
    ───────────────────────────                   ────────────────────────────────
    run prompt, finish, hold blocks ─params─▶ proxy ─▶ admit: allocate, KVLoad
    side channel: handshake ◀──────────────────────── once per prefill engine:
        reply {spec, tp a, every rank's                 compare spec, TP sizes, pairing hash
               transport metadata}
    each rank serves READs ◀──────────────────────── each decode rank d reads its heads from
                                                        prefill rank d // m (notify "<id>:b")
    count notices per request; all b in →         all b ranks done → finish_load → recompute
        release held blocks                         last prompt token, decode
    lease expiry → release held blocks

With a KV secret (docs/security.md, "KV plane"): the prefill signs the kv_transfer_params
it hands out (`remote_mac`, over every field and the prompt) and proves itself on its side
channel as its engine id at its advertised address; a decode loads only params whose MAC
it verified (`verify_params`, before anything is dialed), dials exactly the signed
address, and reads only the blocks the prefill answers its claim with. A claim the
prefill refuses, or blocks it did not issue, are the client's mistake (`ClaimRefused`:
HTTP 400); a transfer that breaks is a 502.

The handshake's messages and checks are handshake.py; the prefill's holds (grants, leases,
read notices) holds.py; which blocks a decode pulls and one load's progress loads.py.
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvrelay import envs
from kvrelay.disagg.auth import (
    WILDCARD_HOSTS,
    check_params,
    load_secret,
    params_mac,
    warn_if_exposed,
)
from kvrelay.disagg.capability import REFUSED, notify_message
from kvrelay.disagg.handshake import Engine, HandshakeError, accept, answer, hello
from kvrelay.disagg.holds import HeldRequests, HoldRefused
from kvrelay.disagg.loads import Load, needed_blocks
from kvrelay.disagg.params import KVTransferConfig
from kvrelay.disagg.side_channel import (
    SideChannelError,
    SideChannelRefused,
    SideChannelServer,
    advertised_host,
    side_channel_call,
)
from kvrelay.disagg.worker import (
    GroupPull,
    KVWork,
    KVWorker,
    KVWorkerSetup,
    LoadEvent,
    PeerInfo,
    PullOrder,
    ReadGrant,
)
from kvrelay.kv_cache.spec import KVCacheSpec

__all__ = ["ClaimRefused", "HandshakeError", "HoldRefused", "KVConnector", "RankLink",
           "TransferStats"]          # the errors: what its callers catch

logger = logging.getLogger(__name__)

class ClaimRefused(HandshakeError):
    """The prefill refused the decode's claim (unknown request, wrong or used capability,
    released or expired hold), or issued other blocks than the params name: the
    kv_transfer_params are not this request's to load. A client's mistake (HTTP 400),
    unlike a transfer that broke (502)."""


class RankLink(Protocol):
    """What the connector needs from a multi-process executor (TP > 1)."""

    def start_kv(self, setup: KVWorkerSetup, own: dict[str, Any]) -> list[dict[str, Any]]:
        """Start every rank's KVWorker; every rank's transport metadata (rank 0's is `own`)."""

    def send_kv(self, work: KVWork) -> None:
        """Deliver `work` to ranks 1..N-1 now (a KV-only broadcast)."""

    def kv_events(self) -> list[tuple]:
        """("load", LoadEvent) and ("notify", [bytes]) reported by ranks 1..N-1 so far."""


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


@dataclass
class KVConnector:
    config: KVTransferConfig
    engine_id: str
    spec: KVCacheSpec
    kv_tensors: list[Any]                  # rank 0's KV tensors
    tp_size: int = 1
    link: RankLink | None = None           # ranks 1..N-1 (None at TP=1)
    port_offset: int = 0  # data-parallel replica r listens on SIDE_CHANNEL_PORT + r
    stats: TransferStats = field(default_factory=TransferStats)

    def __post_init__(self) -> None:
        self.secret = load_secret(self.config.extra)
        # who this engine is in the KV secret's handshake: the server side proves its engine
        # id (what kv_transfer_params name as remote_engine_id); the client side names its role
        self.client_identity = f"{self.config.kv_role}:{self.engine_id}"
        if self.config.is_producer:
            self._check_advertisable()      # before any transport or listener starts
        setup = KVWorkerSetup(self.config, self.engine_id, self.spec.num_kv_heads, self.tp_size)
        self.local = KVWorker(setup, 0, self.kv_tensors)
        self.transport = self.local.transport
        own = self.local.metadata()
        self.rank_metadata = self.link.start_kv(setup, own) if self.link is not None else [own]
        for rank, md in enumerate(self.rank_metadata):
            if "error" in md:
                self.local.close()
                raise RuntimeError(f"KV transfer: tensor-parallel rank {rank} could not start its "
                                   f"transport: {md['error']}")
        kinds = {md.get("transport") for md in self.rank_metadata}
        if len(kinds) > 1:
            self.local.close()
            raise RuntimeError("KV transfer: the tensor-parallel ranks use different transports "
                               f"{[md.get('transport') for md in self.rank_metadata]} (a NIXL "
                               "backend loads in some processes only?)")
        self.stats.transport_fallbacks += int(self.local.fell_back)
        self.num_blocks = self.local.num_blocks
        self.peers: dict[str, PeerInfo] = {}
        self.loads: dict[str, Load] = {}
        self.held = HeldRequests(self.num_blocks)                           # prefill
        self.outbox = KVWork()                 # for ranks 1..N-1: cancels ride with the next step
        self.server: SideChannelServer | None = None
        self.advertised: tuple[str, int] | None = None
        self._notifier = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kvrelay-kv-release")
        self._pending_events: list[tuple] = []
        if self.config.is_producer:
            self._listen()

    @property
    def me(self) -> Engine:
        """This engine in a handshake."""
        return Engine(self.engine_id, self.spec, self.tp_size)

    # -- prefill side -------------------------------------------------------------------
    def _listen(self) -> None:
        host = envs.SIDE_CHANNEL_HOST.raw() or "127.0.0.1"
        port = envs.SIDE_CHANNEL_PORT.as_int() or 0
        port = port + self.port_offset if port else 0
        warn_if_exposed(host, self.secret, "side channel")
        self.server = server = SideChannelServer(host, port, self._handle, secret=self.secret,
                                                 max_connections=self.config.max_connections,
                                                 identity=self.engine_id)
        server.start()
        bound_host, bound_port = server.address
        self.advertised = server.advertised_address
        logger.info("KV side channel listening on %s:%d (advertised %s:%d), transport %s, "
                    "%d rank(s)", bound_host, bound_port, *self.advertised, self.transport.name,
                    self.tp_size)

    def _check_advertisable(self) -> None:
        """With a KV secret a prefill never advertises a wildcard: its kv_transfer_params
        are signed, so kvrelay proxy could not substitute the host (and unsigned, the
        substitute would be the client's pick)."""
        advertised = advertised_host(envs.SIDE_CHANNEL_HOST.raw() or "127.0.0.1")
        if self.secret is not None and advertised.strip() in WILDCARD_HOSTS:
            raise RuntimeError(
                f"KV side channel: with a KV secret the prefill must advertise an address "
                f"decode servers can dial, not {advertised!r} (its kv_transfer_params are "
                f"signed, so kvrelay proxy cannot substitute it): unset or fix "
                f"{envs.SIDE_CHANNEL_ADVERTISE_HOST.name}")

    def _handle(self, message: dict[str, Any]) -> dict[str, Any]:
        kind = message.get("type")
        if kind == "release":                          # decode needed none of the blocks
            self.held.release(message)
            return {"ok": True}
        if kind == "claim":                            # decode is about to read
            return {"ok": True, "block_ids": self.held.grant(message, claim=True).block_ids}
        if kind != "handshake":
            return {"ok": False, "error": f"unknown message type {message.get('type')!r}"}
        return answer(self.me, self.num_blocks, self.rank_metadata, message)

    def hold(self, request_id: str, block_ids: list[list[int]],
             prompt_ids: Sequence[int]) -> dict[str, Any]:
        """Hold a finished prefill's blocks for a decode: its kv_transfer_params (without
        the block ids) including a fresh capability and, with a KV secret, the MAC over
        them, `block_ids` (exactly as the caller returns them) and the prompt's token ids.
        HoldRefused when the blocks held for decodes would exceed `hold_share` of the
        pool (the caller frees them)."""
        grant, blocks = self.held.issue(request_id, block_ids, self.config.hold_share)
        # every rank's TCP transport checks reads against the grant: rank 0 now, the others
        # at once (a KV-only broadcast) so the grant is there before a decode can read.
        # NIXL ranks only need to know that reads are expected (to drive their transport's
        # progress): the grant rides with the next step.
        work = KVWork(grants=[ReadGrant(request_id, grant.capability, blocks)])
        self.local.apply(work)
        if self.link is not None and self.transport.name == "tcp":
            self.link.send_kv(work)
        elif self.link is not None:
            self.outbox.grants.extend(work.grants)
        self.held.start_lease(request_id, self.config.lease_s)
        host, port = self.advertised or ("127.0.0.1", 0)
        where: dict[str, Any] = {
            "remote_engine_id": self.engine_id, "remote_host": host, "remote_port": port,
            "remote_request_id": request_id, "tp_size": self.tp_size,
            "remote_capability": grant.capability}
        if self.secret is not None:
            where["remote_mac"] = params_mac(self.secret, remote_block_ids=block_ids,
                                             prompt_ids=prompt_ids, **where)
        return where

    def holds(self, request_id: str, capability: object) -> bool:
        """Is `request_id` held with this capability (compared in constant time)? The
        explicit free (`POST /v1/kv_transfer/free`) frees nothing otherwise."""
        return self.held.holds(request_id, capability)

    def released(self, request_id: str) -> None:
        if self.held.drop(request_id):
            self.local.apply(KVWork(revokes=[request_id]))
            if self.link is not None:
                self.outbox.revokes.append(request_id)          # with the next step

    def read_done(self) -> list[str]:
        """Held requests every decode rank finished reading (or that decode released)."""
        raw = list(self.local.notifications())
        for notices in self._events("notify"):
            raw.extend(notices)
        done = self.held.read_done(raw)
        self.stats.read_done_notices += len(done)
        return done

    def expired(self) -> list[str]:
        gone = self.held.expired()
        self.stats.leases_expired += len(gone)
        return gone

    # -- decode side --------------------------------------------------------------------
    def verify_params(self, params: Any, prompt_ids: Sequence[int]) -> None:
        """Before anything is dialed or cached (at add_request): may this decode load the
        KV these do_remote_prefill params name, for this prompt? KVParamsError (the
        client's mistake, HTTP 400) unless the side channel is in `allowed_prefills` (when
        configured) and, with a KV secret, `remote_mac` is the MAC a prefill of this
        topology made over exactly these params and this prompt (compared in constant
        time). So with a secret a decode never dials an address a client chose, and never
        loads a prefill's KV for another prompt than the one it was computed for."""
        check_params(params, prompt_ids, self.secret, self.config.allowed_prefills)

    def _call(self, host: str, port: int, message: dict[str, Any], expect_id: str | None,
              timeout: float = 10.0) -> dict[str, Any]:
        """One side-channel request to the prefill `expect_id` at exactly (host, port)."""
        return side_channel_call(host, port, message, timeout=timeout, secret=self.secret,
                                 identity=self.client_identity, expect_id=expect_id)

    def peer(self, engine_id: str, host: str, port: int) -> PeerInfo:
        if engine_id in self.peers:
            return self.peers[engine_id]
        reply = self._call(host, port, hello(self.me), engine_id)
        self.stats.handshakes += 1
        try:
            peer = accept(self.me, engine_id, host, port, reply)
        except HandshakeError:
            self.stats.handshake_errors += 1
            raise
        self.local.apply(KVWork(peers=[peer]))
        if engine_id in self.local.peer_errors:
            raise HandshakeError(self.local.peer_errors[engine_id])
        if self.link is not None:
            self.outbox.peers.append(peer)
        self.peers[engine_id] = peer
        logger.info("KV handshake with %s at %s:%d done (transport %s, prefill TP %d, "
                    "decode TP %d)", engine_id, host, port, self.transport.name, peer.tp_size,
                    self.tp_size)
        return peer

    def start_load(self, request_id: str, params: Any, local_tables: list[list[int]],
                   groups: list[Any], hit_tokens: int, prompt_len: int, block_size: int) -> None:
        peer = self.peer(params.remote_engine_id, params.remote_host, params.remote_port)
        remote_tables = params.remote_block_ids
        if len(remote_tables) != len(local_tables):
            raise HandshakeError(f"prefill sent {len(remote_tables)} block lists, decode has "
                                 f"{len(local_tables)} KV-cache groups")
        pulls = []
        for g, group in enumerate(groups):
            blocks = needed_blocks(group.window, hit_tokens, prompt_len, block_size)
            for i in blocks:
                if i >= len(remote_tables[g]) or remote_tables[g][i] == 0:
                    raise HandshakeError(f"prefill did not keep block {i} of KV-cache group {g}")
                if remote_tables[g][i] >= peer.num_blocks:
                    raise HandshakeError(f"prefill block id {remote_tables[g][i]} is outside its "
                                         f"{peer.num_blocks} blocks")
            if len(blocks):
                pulls.append(GroupPull(group.num_layers, tuple(remote_tables[g][i] for i in blocks),
                                       tuple(local_tables[g][i] for i in blocks)))
        if not pulls:         # our own prefix cache had it all: tell the prefill to free its copy
            self.release_remote(params)
            self.loads[request_id] = Load(request_id, time.monotonic(), set())
            return
        self.claim(params)
        note = notify_message(params.remote_request_id, self.tp_size, params.remote_capability)
        order = PullOrder(request_id, peer.engine_id, note, tuple(pulls))
        self.loads[request_id] = Load(request_id, time.monotonic(), set(range(self.tp_size)))
        if self.link is not None:
            # ranks ≥ 1 get the order at once (with any queued peers/cancels), before rank 0
            # builds its own read: waiting for rank 0's read setup, or for the next step,
            # delayed rank 1's start by 60-160 ms on this machine
            self.outbox.pulls.append(order)
            self.link.send_kv(self._take_outbox())
        self._pending_events.extend(("load", e) for e in self.local.apply(KVWork(pulls=[order])))

    def claim(self, params: Any) -> None:
        """Before any read: present the request's capability to the prefill, which answers
        with the blocks it issued for that request (once). Block ids that a client put in
        kv_transfer_params are read only if they are exactly those. ClaimRefused (the
        client's mistake) when the prefill refuses the claim or issued other blocks;
        HandshakeError when the side channel fails."""
        try:
            reply = self._call(params.remote_host, params.remote_port,
                               {"type": "claim", "request_id": params.remote_request_id,
                                "capability": params.remote_capability}, params.remote_engine_id)
        except SideChannelRefused as e:
            if e.reason != REFUSED:              # e.g. an incompatible peer: not the client's
                raise HandshakeError(f"the prefill refused to hand over request "
                                     f"{params.remote_request_id!r}'s KV: {e}") from None
            raise ClaimRefused(f"KV transfer refused: the prefill refused to hand over the KV "
                               f"that kv_transfer_params name (request "
                               f"{params.remote_request_id!r}: released, expired, claimed "
                               f"already or never issued): {e}") from None
        except SideChannelError as e:
            raise HandshakeError(f"the prefill refused to hand over request "
                                 f"{params.remote_request_id!r}'s KV: {e}") from None
        if reply.get("block_ids") != params.remote_block_ids:
            raise ClaimRefused(f"KV transfer refused: kv_transfer_params.remote_block_ids are "
                               f"not the blocks the prefill issued for request "
                               f"{params.remote_request_id!r}")

    def take_work(self) -> KVWork | None:
        """KV work for ranks 1..N-1 accumulated since the last call (None when there is none)."""
        work = self._take_outbox()
        return work if work else None

    def _take_outbox(self) -> KVWork:
        work, self.outbox = self.outbox, KVWork()
        return work

    def release_remote(self, params: Any) -> None:
        """Ask the prefill (in the background) to free blocks we will not read."""

        def send() -> None:
            try:
                self._call(params.remote_host, params.remote_port,
                           {"type": "release", "request_id": params.remote_request_id,
                            "capability": params.remote_capability}, params.remote_engine_id,
                           timeout=5)
            except Exception as e:  # the prefill's lease frees them anyway
                logger.warning("could not ask %s:%s to free %s: %s", params.remote_host,
                               params.remote_port, params.remote_request_id, e)
        self._notifier.submit(send)

    def _events(self, kind: str) -> list[Any]:
        """Rank events of one kind (the others are kept for the next call)."""
        if self.link is not None:
            self._pending_events.extend(self.link.kv_events())
        mine = [p for k, p in self._pending_events if k == kind]
        self._pending_events = [(k, p) for k, p in self._pending_events if k != kind]
        return mine

    def poll_loads(self) -> list[tuple[str, str | None]]:
        """Loads every rank finished as (request id, error or None). A load fails when a
        rank's read fails or it times out; the other ranks' reads are cancelled."""
        events: list[LoadEvent] = self.local.poll() + self._events("load")
        for e in events:
            load = self.loads.get(e.request_id)
            if load is not None:
                load.record(e, time.monotonic())
        finished = []
        now = time.monotonic()
        for request_id, load in list(self.loads.items()):
            if (load.waiting and load.error is None
                    and now - load.started > self.config.load_timeout_s):
                load.error = f"timed out after {self.config.load_timeout_s:.0f}s"
            if load.waiting and load.error is None:
                continue
            if load.waiting:
                self._cancel_reads(request_id)
            del self.loads[request_id]
            if logger.isEnabledFor(logging.DEBUG):
                timings = {r: tuple(round(1000 * x, 1) for x in v)
                           for r, v in sorted(load.ranks.items())}
                logger.debug("KV load %s: %d bytes in %.1f ms (per rank: started +ms, read ms, "
                             "seen +ms: %s)%s", request_id, load.nbytes,
                             1000 * (now - load.started), timings,
                             f", failed: {load.error}" if load.error else "")
            if load.error is None:
                self.stats.transfers += 1
                self.stats.bytes += load.nbytes
                self.stats.seconds += now - load.started
            else:
                self.stats.failed += 1
            finished.append((request_id, load.error))
        return finished

    def _cancel_reads(self, request_id: str) -> None:
        self.local.cancel(request_id)
        if self.link is not None:
            self.outbox.cancels.append(request_id)

    def cancel(self, request_id: str, params: Any = None) -> None:
        """The request was aborted while loading: drop the reads, free the prefill's blocks."""
        load = self.loads.pop(request_id, None)
        if load is None:
            return
        if load.waiting:
            self._cancel_reads(request_id)
        if params is not None:
            self.release_remote(params)

    @property
    def busy(self) -> bool:
        return bool(self.loads or self.held.leases or self.outbox)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self._notifier.shutdown(wait=False)
        self.local.close()
