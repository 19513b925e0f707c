"""A per-client rate bound on the KV holds that `do_remote_decode` requests place.

A prefill keeps a `do_remote_decode` request's KV blocks until a decode reads them, or
for at most `lease_s`. `hold_share` bounds all holds together (a share of the pool);
this bounds how fast one client may place them, so a client sending such requests
straight to a prefill cannot take the whole share for itself: a token bucket per client
of `hold_rate` holds per second, up to `hold_burst` at once
(`kv_connector_extra_config.hold_rate` / `hold_burst`). Over it: 429 with Retry-After.

The bucket is charged with what the engine holds for: `kv_transfer_params` parsed once
(`serving.kv_transfer_params`; `do_remote_decode` must be a JSON boolean), charged just
before the request goes to the engine and refunded when the server's queue refuses it.

Who is a client (the server decides, see `serving._hold_client`): the peer address. Requests
that present the server's `--api-key` are not bounded: only the operator's components
(the proxy) hold it, and one shared key cannot tell clients apart, so a bucket on it
would only throttle the proxy. Behind a proxy without keys every request comes from the
proxy's address, which is why the defaults are generous (docs/security.md).

Memory: at most `max_clients` buckets; past it the least recently seen client is
forgotten (it comes back with a full bucket, as a new client would). The defaults
(100 holds/s, burst 200) are in `kvrelay/disagg/params.py`.
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

MAX_CLIENTS = 4096


@dataclass
class _Bucket:
    tokens: float
    stamp: float        # clock reading when `tokens` was right


class HoldRateLimiter:
    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic,
                 max_clients: int = MAX_CLIENTS) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"hold rate must be > 0 and burst >= 1, got {rate} and {burst}")
        self.rate, self.burst, self.clock, self.max_clients = rate, burst, clock, max_clients
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def take(self, client: str) -> float | None:
        """Take one hold for `client`: None when it may place it, else the seconds until
        it may (nothing is taken then)."""
        now = self.clock()
        bucket = self._buckets.pop(client, None) or _Bucket(self.burst, now)
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.stamp) * self.rate)
        bucket.stamp = now
        self._buckets[client] = bucket                     # most recently seen last
        while len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)
        if bucket.tokens >= 1:
            bucket.tokens -= 1
            return None
        return (1 - bucket.tokens) / self.rate

    def refund(self, client: str) -> None:
        """Give back one hold taken for `client` (its request never reached the engine)."""
        bucket = self._buckets.get(client)
        if bucket is not None:
            bucket.tokens = min(self.burst, bucket.tokens + 1)

    def message(self, wait_s: float) -> str:
        return (f"too many KV holds from this client: at most {self.rate:g} do_remote_decode "
                f"requests per second, {self.burst:g} at once (kv_connector_extra_config."
                f"hold_rate / hold_burst); retry after {retry_after(wait_s)} s")


def retry_after(wait_s: float) -> int:
    """Retry-After is whole seconds: round up, at least 1."""
    return max(1, math.ceil(wait_s))
