"""The KV handshake: once per prefill engine, before a decode's first read, on the prefill's
side channel.

    decode ── hello {version, engine_id, spec, tp_size} ──────────────────▶ prefill
           ◀─ {ok, engine_id, spec, tp_size, num_blocks, ranks, compat_hash} ── answer
    accept: the same checks on the decode's side, then a `PeerInfo`
            (every prefill rank's transport metadata, bytes base64-coded on the wire)

Both sides refuse a different KV-cache spec (model config, dtype, block size, layers, KV
heads, head size, layout, hybrid) or TP sizes that do not pair (decode's a multiple of
prefill's, disagg/layout.py), phrased the same on both: "block_size: prefill 4, decode 8".
"""
from __future__ import annotations

import base64
import hashlib
import logging
from dataclasses import dataclass
from typing import Any

from kvrelay.disagg.layout import tp_mismatch
from kvrelay.disagg.worker import PeerInfo
from kvrelay.kv_cache.spec import KVCacheSpec

logger = logging.getLogger(__name__)

HANDSHAKE_VERSION = 2       # 2: every rank's transport metadata, TP sizes, pairing hash


class HandshakeError(RuntimeError):
    pass


@dataclass(frozen=True)
class Engine:
    """One side of a handshake: this engine's id, KV-cache spec and TP size."""
    engine_id: str
    spec: KVCacheSpec
    tp_size: int


def pairing_hash(spec: dict[str, Any], prefill_tp: int, decode_tp: int) -> str:
    """The handshake's compatibility hash: the KV-cache spec and both TP sizes."""
    blob = repr((sorted(spec.items()), prefill_tp, decode_tp)).encode()
    return hashlib.sha256(blob).hexdigest()


def hello(decode: Engine) -> dict[str, Any]:
    """The decode's handshake message."""
    return {"type": "handshake", "version": HANDSHAKE_VERSION, "engine_id": decode.engine_id,
            "spec": decode.spec.__dict__, "tp_size": decode.tp_size}


def answer(prefill: Engine, num_blocks: int, rank_metadata: list[dict[str, Any]],
           message: dict[str, Any]) -> dict[str, Any]:
    """The prefill's reply to a decode's handshake `message` (refusals logged)."""
    if message.get("version") != HANDSHAKE_VERSION:
        return {"ok": False,
                "error": f"handshake version {message.get('version')} != {HANDSHAKE_VERSION} "
                         f"(prefill and decode run different kvrelay versions)"}
    theirs = message.get("spec") or {}
    problems = _spec_differences(prefill.spec, theirs, "prefill", "decode")
    decode_tp = message.get("tp_size")
    tp_problem = tp_mismatch(prefill.tp_size, decode_tp) if isinstance(decode_tp, int) else \
        f"decode sent tp_size {decode_tp!r}"
    if tp_problem:
        problems.append(tp_problem)
    if problems or not isinstance(decode_tp, int):    # (an int when there is no problem)
        logger.error("refused a KV handshake from %s: incompatible KV cache (%s)",
                     message.get("engine_id"), "; ".join(problems))
        return {"ok": False, "error": "incompatible KV cache: " + "; ".join(problems)}
    return {"ok": True, "engine_id": prefill.engine_id, "spec": prefill.spec.__dict__,
            "tp_size": prefill.tp_size, "num_blocks": num_blocks,
            "ranks": [_encode(md) for md in rank_metadata],
            "compat_hash": pairing_hash(prefill.spec.__dict__, prefill.tp_size, decode_tp)}


def accept(decode: Engine, engine_id: str, host: str, port: int,
           reply: dict[str, Any]) -> PeerInfo:
    """The prefill `engine_id` at host:port as a peer, from its `reply`; HandshakeError when
    it refused or does not pair with this decode."""
    if not reply.get("ok"):
        raise HandshakeError(f"prefill engine at {host}:{port} refused the handshake: "
                             f"{reply.get('error')}")
    problems = _spec_differences(decode.spec, reply.get("spec") or {}, "decode", "prefill")
    prefill_tp = reply.get("tp_size")
    tp_problem = tp_mismatch(prefill_tp, decode.tp_size) if isinstance(prefill_tp, int) else \
        f"prefill sent tp_size {prefill_tp!r}"
    if tp_problem:
        problems.append(tp_problem)
    ranks = reply.get("ranks")
    if not problems and (not isinstance(ranks, list) or len(ranks) != prefill_tp):
        problems.append(f"prefill sent transport metadata for {len(ranks or [])} of its "
                        f"{prefill_tp} ranks")
    if not problems and isinstance(prefill_tp, int) and (
            reply.get("compat_hash")
            != pairing_hash(decode.spec.__dict__, prefill_tp, decode.tp_size)):
        problems.append("compatibility hash differs (KV cache spec serialised differently)")
    # (with no problem, prefill_tp is an int and ranks a list: checked above)
    if problems or not isinstance(prefill_tp, int) or not isinstance(ranks, list):
        raise HandshakeError("incompatible KV cache: " + "; ".join(problems))
    return PeerInfo(engine_id, prefill_tp, int(reply["num_blocks"]),
                    tuple(_decode(md) for md in ranks))


def _spec_differences(mine: KVCacheSpec, theirs: dict[str, Any], me: str, them: str) -> list[str]:
    """What differs, phrased the same on both sides: "block_size: prefill 4, decode 8"."""
    fields = mine.__dict__

    def say(key: str, a: Any, b: Any) -> str:
        pair = {me: a, them: b}
        return f"{key}: prefill {pair['prefill']!r}, decode {pair['decode']!r}"

    diffs = [say(k, fields[k], theirs.get(k))
             for k in fields if k != "model" and fields[k] != theirs.get(k)]
    if fields["model"].split(":")[-1] != str(theirs.get("model", "")).split(":")[-1]:
        diffs.insert(0, say("model config", fields["model"], theirs.get("model")))
    return diffs


def _encode(metadata: dict[str, Any]) -> dict[str, Any]:
    return {k: {"__b64__": base64.b64encode(v).decode()} if isinstance(v, bytes) else v
            for k, v in metadata.items()}


def _decode(metadata: dict[str, Any]) -> dict[str, Any]:
    return {k: base64.b64decode(v["__b64__"]) if isinstance(v, dict) and "__b64__" in v else v
            for k, v in metadata.items()}
