"""The prefill's held requests: the blocks it keeps for decodes, who may read them, and when
they are freed.

    hold      (engine)        a grant per request: a fresh capability and the blocks issued;
                              the blocks held for decodes stay within `hold_share` of the pool
    claim     (side channel)  a decode presents the capability before it reads: answered
                              with the issued blocks, once
    release   (side channel)  a decode needed none of the blocks
    read_done (engine)        a decode rank's read notice carries the capability; all b
                              notices in (b: the decode's TP size) → the request is done
    expired   (engine)        the lease ran out
    drop      (engine)        the engine freed the blocks: the grant and its counts go

The side channel's threads read the grants (`grant`, `release`) while the engine thread
changes them, so every grant access holds `lock`.
"""
from __future__ import annotations

import collections
import secrets
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvrelay.disagg.capability import REFUSED, capability_matches, parse_notify
from kvrelay.disagg.framed_server import warn_limited
from kvrelay.disagg.side_channel import SideChannelError


class HoldRefused(RuntimeError):
    """Holding a finished request's blocks for a decode would exceed the hold share."""


@dataclass
class Grant:
    """What the prefill issued for one held request: the capability a decode must present
    and the blocks it may read. A grant is claimed (read) once."""
    capability: str
    block_ids: list[list[int]]
    claimed: bool = False


class HeldRequests:
    """Owner of the prefill's holds: each held request's grant, lease deadline and read
    notices counted, the blocks held for decodes (with how many grants name each), and
    the releases the side channel received."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.grants: dict[str, Grant] = {}
        self.blocks: collections.Counter[int] = collections.Counter()
        self.leases: dict[str, float] = {}                   # request → deadline (monotonic)
        self.notices: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()              # the side channel's threads read grants
        self._released: collections.deque[str] = collections.deque()   # from the side channel

    # -- the engine thread --------------------------------------------------------------
    def issue(self, request_id: str, block_ids: list[list[int]],
              hold_share: float) -> tuple[Grant, frozenset[int]]:
        """A new grant over `block_ids` and the (non-null) blocks it names; HoldRefused when
        the blocks held for decodes would exceed `hold_share` of the pool."""
        blocks = {b for ids in block_ids for b in ids if b}
        with self.lock:
            new = sum(1 for b in blocks if b not in self.blocks)
            limit = int(hold_share * self.num_blocks)
            if len(self.blocks) + new > limit:
                raise HoldRefused(
                    f"KV hold refused: {len(self.blocks)} of this prefill server's "
                    f"{self.num_blocks} KV blocks are already held for decode servers and this "
                    f"request needs {new} more (at most {limit}: kv_connector_extra_config."
                    f"hold_share {hold_share:g}); retry later")
            grant = Grant(secrets.token_urlsafe(32), [list(ids) for ids in block_ids])
            self.grants[request_id] = grant
            self.blocks.update(blocks)
        return grant, frozenset(blocks)

    def start_lease(self, request_id: str, lease_s: float) -> None:
        self.leases[request_id] = time.monotonic() + lease_s

    def holds(self, request_id: str, capability: object) -> bool:
        """Is `request_id` held with this capability (compared in constant time)?"""
        with self.lock:
            grant = self.grants.get(request_id)
            return grant is not None and capability_matches(capability, grant.capability)

    def drop(self, request_id: str) -> bool:
        """Forget `request_id`'s hold; whether it had a grant."""
        self.leases.pop(request_id, None)
        self.notices.pop(request_id, None)
        with self.lock:
            grant = self.grants.pop(request_id, None)
            if grant is not None:
                self.blocks.subtract({b for ids in grant.block_ids for b in ids if b})
                self.blocks += collections.Counter()        # drop zero counts
        return grant is not None

    def read_done(self, raw: Iterable[bytes]) -> list[str]:
        """Held requests whose every decode rank's notice is among `raw` (with those counted
        before), or that decode released."""
        done = []
        for note in raw:
            parsed = parse_notify(note)
            with self.lock:
                grant = self.grants.get(parsed[0]) if parsed else None
            if grant is None or parsed is None:
                continue                  # malformed, or released already (lease, explicit free)
            request_id, needed, capability = parsed
            if not capability_matches(capability, grant.capability):
                warn_limited("ignored a KV read-done notice for %.100r with a wrong capability",
                             request_id)
                continue
            self.notices[request_id] += 1
            if self.notices[request_id] == needed:
                done.append(request_id)
        while self._released:
            request_id = self._released.popleft()
            if request_id in self.leases and request_id not in done:
                done.append(request_id)
        return done

    def expired(self) -> list[str]:
        now = time.monotonic()
        return [r for r, deadline in self.leases.items() if deadline <= now]

    # -- the side channel's threads -----------------------------------------------------
    def grant(self, message: dict[str, Any], claim: bool) -> Grant:
        """The live grant `message` names with its capability; SideChannelError with nothing
        but REFUSED otherwise. A grant is claimed once."""
        request_id, capability = message.get("request_id"), message.get("capability")
        with self.lock:
            grant = self.grants.get(request_id) if isinstance(request_id, str) else None
            valid = grant is not None and capability_matches(capability, grant.capability)
            if grant is None or not valid or (claim and grant.claimed):
                warn_limited("KV side channel: refused a %s for request %.100r: %s",
                             message.get("type"), request_id, REFUSED)
                raise SideChannelError(REFUSED)
            grant.claimed = grant.claimed or claim
            return grant

    def release(self, message: dict[str, Any]) -> None:
        """A decode needs none of the blocks (checked like a claim, read by `read_done`)."""
        self.grant(message, claim=False)
        self._released.append(message["request_id"])
