"""A held request's capability and the read notices that carry it (prefill side checks,
decode side sends). Shared by the connector (scheduler side) and the KV worker (per
rank) without either importing the other; standard library only."""
from __future__ import annotations

import hmac

REFUSED = "unknown request or wrong capability"     # all a peer learns about a bad claim/release


def notify_message(remote_request_id: str, decode_tp: int, capability: str) -> bytes:
    """What each decode rank's read tells the prefill: the request, how many ranks read,
    and the request's capability (a notice without the right one frees nothing)."""
    return f"{remote_request_id}:{decode_tp}:{capability}".encode()


def parse_notify(raw: bytes) -> tuple[str, int, str] | None:
    """(request id, number of notices that complete it, capability); None if malformed."""
    parts = raw.decode(errors="replace").rsplit(":", 2)
    if len(parts) != 3 or not parts[1].isdigit() or int(parts[1]) < 1:
        return None
    return parts[0], int(parts[1]), parts[2]


def capability_matches(given: object, issued: str) -> bool:
    """Constant-time comparison of a presented capability with the issued one."""
    return isinstance(given, str) and hmac.compare_digest(given.encode(), issued.encode())
