"""What two KV caches must agree on to exchange blocks (disaggregated serving).

Prefill and decode servers exchange this spec in the side-channel handshake
(`disagg/handshake.py`) and compare it field by field, then both TP sizes and a hash of
spec and TP sizes (`pairing_hash`); a mismatch is an error naming the differing fields,
never garbage. `compat_hash()` and `differences()` are the same checks on two specs held
in one process. `numerics` names how the KV was computed (model/execution_plan.py), so two
servers whose execution plans would write different KV bytes for one prompt refuse to pair.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

KV_LAYOUT = "layer:[2,num_blocks,kv_heads,block_size,head_dim];hybrid-groups-share-tensors"


@dataclass(frozen=True)
class KVCacheSpec:
    model: str                    # a fingerprint of the checkpoint (name + config hash)
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int             # total, before tensor-parallel sharding
    head_size: int
    hybrid: bool                  # sliding-window layers in their own group
    sliding_window: int | None
    layout: str = KV_LAYOUT
    version: int = 1
    # what decides the KV bytes besides the dtype: the matmul precision of half-precision
    # models (`ExecutionPlan.numerics`, e.g. "kv=bfloat16;matmul=native-bfloat16"); a prefill
    # and a decode that would compute the same prompt's KV differently do not pair
    numerics: str = ""

    def compat_hash(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()

    def differences(self, other: KVCacheSpec) -> list[str]:
        mine, theirs = asdict(self), asdict(other)
        return [f"{k}: {mine[k]!r} vs {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]
