"""The engine's side of disaggregated serving: between the scheduler and the KV connector.

Owner of: the `KVConnector` (None without --kv-transfer-config) and the checks on a
request's `kv_transfer_params`. The scheduler owns the requests and their blocks; this
glue tells it when a KV load finished or failed and when a held prefill's blocks may
go, and it tells the connector which blocks to hold, load or release.

    decode  (do_remote_prefill):  check → scheduler admits → start_loads → poll → run
    prefill (do_remote_decode):   runs → finishes → hold (kv_transfer_params out)
                                  → poll: read-done / lease expired / free_remote → release

HTTP statuses of a decode's KV failures (the request's `error_status`): params that are
malformed, not signed for this prompt (KV secret) or outside `allowed_prefills` are
refused at `check` (400, before anything is dialed); a claim the prefill refuses or
block ids it did not issue are 400 too (`ClaimRefused`: nothing was read); a handshake,
connection or read that fails is 502. Policy "recompute" recomputes the prompt locally
instead of either of the last two (it reads nothing from the prefill).
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

from kvrelay.disagg.connector import ClaimRefused, HoldRefused, KVConnector
from kvrelay.disagg.params import KVParamsError, KVTransferConfig, KVTransferParams
from kvrelay.engine.outputs import RequestOutput
from kvrelay.engine.request import Request
from kvrelay.engine.scheduler import Scheduler
from kvrelay.engine.scheduler_output import SchedulerOutput
from kvrelay.kv_cache.manager import KVCacheManager
from kvrelay.kv_cache.spec import KVCacheSpec

logger = logging.getLogger(__name__)


class KVTransferGlue:
    def __init__(self, config: KVTransferConfig | None, scheduler: Scheduler,
                 kv: KVCacheManager, block_size: int) -> None:
        self.config, self.scheduler, self.kv, self.block_size = config, scheduler, kv, block_size
        self.connector: KVConnector | None = None

    def start(self, spec: KVCacheSpec, kv_tensors: list[Any], tp_size: int, link: Any,
              port_offset: int) -> None:
        """Every TP rank registers its KV shard with its own transport (the executor
        starts ranks 1..N-1's); the side channel listens here, on rank 0's process."""
        if self.config is None:
            return
        engine_id = self.config.engine_id or f"kvrelay-{uuid.uuid4().hex[:12]}"
        self.connector = KVConnector(self.config, engine_id, spec, kv_tensors, tp_size=tp_size,
                                     link=link, port_offset=port_offset)
        logger.info("KV transfer: role %s, engine id %s, transport %s", self.config.kv_role,
                    engine_id, self.connector.transport.name)

    @property
    def recompute(self) -> bool:
        return self.config is not None and self.config.kv_load_failure_policy == "recompute"

    @property
    def busy(self) -> bool:
        """KV loads in flight or blocks held for decode servers (needs periodic polling)."""
        return self.connector is not None and self.connector.busy

    def check(self, raw: dict | None, prompt_ids: Sequence[int]) -> KVTransferParams | None:
        """A request's kv_transfer_params against this server's role and KV layout, and
        (decode) against the prefill's MAC and `allowed_prefills` for this prompt
        (`KVConnector.verify_params`): KVParamsError (400) before anything is dialed."""
        p = KVTransferParams.from_dict(raw)
        if p is None or not (p.do_remote_decode or p.do_remote_prefill):
            return None
        cfg = self.config
        if p.do_remote_decode and not (cfg and cfg.is_producer):
            raise KVParamsError("kv_transfer_params.do_remote_decode needs a server started "
                                "with --kv-transfer-config kv_role kv_producer or kv_both")
        if p.do_remote_prefill and not (cfg and cfg.is_consumer):
            raise KVParamsError("kv_transfer_params.do_remote_prefill needs a server started "
                                "with --kv-transfer-config kv_role kv_consumer or kv_both")
        remote = p.remote_block_ids or []
        if p.do_remote_prefill and len(remote) != len(self.kv.groups):
            raise KVParamsError(f"kv_transfer_params.remote_block_ids has {len(remote)} lists; "
                                f"this server has {len(self.kv.groups)} KV-cache groups (hybrid "
                                f"KV cache manager settings must match)")
        if p.do_remote_prefill and self.connector is not None:
            self.connector.verify_params(p, prompt_ids)
        return p

    def poll(self) -> list[Request]:
        """Finished KV loads (decode) and read-done notices / lease expiries (prefill);
        returns the requests whose load failed for good."""
        if self.connector is None:
            return []
        failed = []
        for request_id, error in self.connector.poll_loads():
            req = self.scheduler.loading.get(request_id)
            self.scheduler.finish_load(request_id, error, self.recompute)
            if req is not None and req.error:
                failed.append(req)
        for request_id in self.connector.read_done() + self.connector.expired():
            self.connector.released(request_id)
            self.scheduler.release_held(request_id)
        return failed

    def start_loads(self, out: SchedulerOutput) -> list[Request]:
        """Start the KV loads the scheduler admitted; returns the requests that failed.
        (Only requests that `check` let in load, and it needs a consumer's connector.)"""
        failed: list[Request] = []
        connector = self.connector
        if connector is None:
            return failed
        for load in out.loads:
            req = load.request
            try:
                connector.start_load(req.request_id, req.kv_transfer,
                                     self.kv.block_ids(req.request_id), self.kv.groups,
                                     load.hit_tokens, req.num_prompt_tokens, self.block_size)
            except ClaimRefused as e:     # not this request's KV: the client's mistake, 400
                logger.warning("KV load for %s refused: %s", req.request_id, e)
                connector.stats.failed += 1
                self.scheduler.finish_load(req.request_id, str(e), self.recompute)
                if req.error:             # policy "fail" (recompute reads nothing remote)
                    req.error, req.error_status = str(e), 400
                    failed.append(req)
            except Exception as e:  # noqa: BLE001 -- handshake/transport: this request only
                logger.error("KV load for %s failed to start: %s", req.request_id, e)
                connector.stats.failed += 1
                self.scheduler.finish_load(req.request_id, str(e), self.recompute)
                if req.error:
                    failed.append(req)
        return failed

    def take_work(self) -> Any:
        """KV reads for ranks 1..N-1 to start with the next step (None: none)."""
        return self.connector.take_work() if self.connector is not None else None

    def hold(self, out: RequestOutput, first: Request) -> None:
        """A finished do_remote_decode request: hold its blocks for the decode server and
        tell the client where they are (out.kv_transfer_params), or — over the hold
        share — free them now and fail the request with 503 (busy, not broken)."""
        if not (out.finished and first.remote_decode and first.request_id in self.scheduler.held):
            return
        block_ids = self.kv.block_ids(first.request_id)
        assert self.connector is not None       # holds exist only with a producer's connector
        try:
            where = self.connector.hold(first.request_id, block_ids, first.prompt_token_ids)
        except HoldRefused as e:
            self.scheduler.release_held(first.request_id)
            out.error, out.error_status = str(e), 503
            return
        out.kv_transfer_params = KVTransferParams(do_remote_prefill=True, do_remote_decode=False,
                                                  remote_block_ids=block_ids, **where).to_dict()

    def free_remote(self, request_id: str, capability: str | None) -> bool:
        """Prefill side: an explicit free from the proxy (client gone, decode failed). Only
        with the capability the request was held with: a wrong or missing one, or an id
        not held, frees nothing and gets the same False (the caller learns no more)."""
        if self.connector is None or not self.connector.holds(request_id, capability):
            return False
        self.connector.released(request_id)
        return self.scheduler.release_held(request_id)

    def cancel(self, req: Request) -> None:
        """An aborted request: its load (decode) stops."""
        if self.connector is not None:
            self.connector.cancel(req.request_id, req.kv_transfer)

    def release(self, req: Request) -> None:
        """A failed request: blocks it held for a decode server are freed now."""
        if req.request_id in self.scheduler.held:
            if self.connector is not None:
                self.connector.released(req.request_id)
            self.scheduler.release_held(req.request_id)

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()
            self.connector = None
