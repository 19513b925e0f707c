"""The messages between the API process and an engine core (and the data-parallel
handshake): typed msgspec Structs, one codec for all of them (`engine/codec.py`).

    API process ──AddRequest | AbortRequests | FreeRemote | Wake | Shutdown──▶ engine core
    API process ◀──Ready | StepOutputs | RequestRefused | Freed | Fatal────── engine core

Each message is a tagged, array-like Struct: on the wire a msgpack array
`[tag, ...field values]`, decoded straight into its class by a decoder typed with the
union it may be (`ToEngine`, `FromEngine`, `Handshake`). The same bytes cross the
`multiprocessing` pipe on this node and the TCP link to a headless node
(`engine/dp_link.py`); nothing is pickled.

`StepOutputs` carries only what changed in the step (new token ids, new text, new
logprobs), never tensors; `EngineStats` is the core's snapshot after that step, and
`EngineInfo` what it resolved once at start-up.

This module imports no torch, so the API process can use it without loading a model.
"""
from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from kvrelay.engine.outputs import CompletionOutput, RequestOutput
from kvrelay.sampling_params import SamplingParams

if TYPE_CHECKING:
    ParamsOnWire = SamplingParams
else:
    class ParamsOnWire(abc.ABC):  # noqa: B024 -- a marker: SamplingParams is registered
        """`SamplingParams` as msgspec sees it: a custom type (its logits processors are
        callables, which msgspec cannot type), encoded as the map of its fields and decoded
        by `codec._dec_hook`, which builds it again (and so validates it again)."""

    ParamsOnWire.register(SamplingParams)


if TYPE_CHECKING:
    _MappingBase = Mapping[str, Any]
else:
    _MappingBase = object


class _Record(_MappingBase):
    """A Struct that also reads as a mapping of its (non-None) fields, for the readers
    that take the engine's numbers by name (Prometheus metrics, the launcher)."""

    __slots__ = ()
    __struct_fields__: ClassVar[tuple[str, ...]]

    def _items(self) -> dict[str, Any]:
        return {k: v for k in self.__struct_fields__ if (v := getattr(self, k)) is not None}

    def __getitem__(self, key: str) -> Any:
        return self._items()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._items())

    # the rest of Mapping's methods, in terms of the three above (a Struct cannot inherit
    # from Mapping: their metaclasses differ; the classes are registered as Mappings)
    __contains__ = Mapping.__contains__
    get = Mapping.get
    keys = Mapping.keys
    items = Mapping.items
    values = Mapping.values


# -- what an engine core reports ------------------------------------------------------------
class EngineStats(_Record, msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The engine core's counters after a step. The `kv_*` fields are None without a KV
    connector (no disaggregation), the `spec_decode_*` ones without --speculative-config,
    so they are not exported then."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage_perc: float = 0.0
    blocks_free: int = 0
    blocks_used: int = 0
    blocks_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    dp_dummy_steps: int = 0
    kv_transfers: int | None = None
    kv_transfer_failures: int | None = None
    kv_transfer_bytes: int | None = None
    kv_transfer_seconds: float | None = None
    kv_handshakes: int | None = None
    kv_handshake_errors: int | None = None
    kv_transport_fallbacks: int | None = None
    kv_blocks_held_for_remote: int | None = None
    kv_requests_held_for_remote: int | None = None
    kv_leases_expired: int | None = None
    kv_read_done_notices: int | None = None
    kv_loads_in_flight: int | None = None
    spec_decode_num_drafts: int | None = None
    spec_decode_num_draft_tokens: int | None = None
    spec_decode_num_accepted_tokens: int | None = None
    spec_decode_accepted_per_pos: tuple[int, ...] | None = None   # [j]: drafts accepted at j

    @classmethod
    def total(cls, replicas: list[EngineStats]) -> EngineStats:
        """The data-parallel sum: counters add up (per position, too); the KV usage is the
        replicas' mean."""
        if not replicas:
            return cls()
        summed: dict[str, Any] = {}
        for name in cls.__struct_fields__:
            values = [getattr(s, name) for s in replicas if getattr(s, name) is not None]
            summed[name] = _sum(values) if values else None
        summed["kv_cache_usage_perc"] /= len(replicas)
        return cls(**summed)


def _sum(values: list[Any]) -> Any:
    """Numbers added; tuples of counts added position by position."""
    if not isinstance(values[0], tuple):
        return sum(values)
    width = max(len(v) for v in values)
    return tuple(sum(v[j] for v in values if j < len(v)) for j in range(width))


class EngineInfo(_Record, msgspec.Struct, frozen=True, array_like=True):
    """What the engine core resolved at start-up (sent with `Ready`; again, with a second
    `Ready`, when the native kernels built in the background switch in)."""

    max_model_len: int
    model_dir: str
    pid: int
    vocab_size: int
    kv_cache_spec: dict[str, Any] = msgspec.field(default_factory=dict)
    native: dict[str, Any] = msgspec.field(default_factory=dict)  # CPU kernels / matmul path


Mapping.register(EngineStats)
Mapping.register(EngineInfo)


class _Message(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Every message: its class's tag is the first element of its array on the wire."""

    @property
    def tag(self) -> str:
        return str(self.__struct_config__.tag)


# -- API process → engine core ----------------------------------------------------------------
class AddRequest(_Message, frozen=True, tag="add"):
    request_id: str
    prompt: list[int]
    params: ParamsOnWire
    kv_transfer_params: dict[str, Any] | None = None


class AbortRequests(_Message, frozen=True, tag="abort"):
    request_ids: list[str]


class FreeRemote(_Message, frozen=True, tag="free_remote"):
    """Free the blocks a prefill holds for a decode under `request_id` if `capability`
    is the one they were held with; answered by `Freed` with the same `token`."""

    request_id: str
    capability: str
    token: int


class Wake(_Message, frozen=True, tag="wake"):
    """Lockstep replicas (`engine/lockstep.py`): a request was added somewhere (wave n)."""

    wave: int


class Shutdown(_Message, frozen=True, tag="shutdown"):
    pass


# -- engine core → API process ----------------------------------------------------------------
class Ready(_Message, frozen=True, tag="ready"):
    info: EngineInfo
    stats: EngineStats


class StepOutputs(_Message, frozen=True, tag="outputs"):
    """One step's deltas (possibly none: a stats-only update) and the stats after it."""

    outputs: list[RequestOutput]
    stats: EngineStats


class RequestRefused(_Message, frozen=True, tag="error"):
    """The core did not add a request: status 400 the request is invalid (`param` names
    the field), 500 adding it raised anything else (nothing of it stays in the engine)."""

    request_id: str
    message: str
    status: int = 400
    param: str | None = None


class Freed(_Message, frozen=True, tag="freed"):
    token: int
    freed: bool


class Fatal(_Message, frozen=True, tag="fatal"):
    """The core failed to start, or its shared state broke: it ends."""

    reason: str


# -- the data-parallel head ⇄ headless node handshake (engine/dp_link.py) ------------------
class Layout(msgspec.Struct, frozen=True, array_like=True):
    """What a head and its headless nodes must agree on."""

    data_parallel_size: int
    tensor_parallel_size: int
    enable_expert_parallel: bool
    model_config: str              # a hash of the model's config.json


class Hello(_Message, frozen=True, tag="hello"):
    """A headless node's first frame: its layout and the replica ranks it runs."""

    version: int
    layout: Layout
    start_rank: int
    local_size: int


class Welcome(_Message, frozen=True, tag="welcome"):
    master_port: int | None        # the expert world's port (experts across replicas)


class Reject(_Message, frozen=True, tag="reject"):
    error: str


ToEngine = AddRequest | AbortRequests | FreeRemote | Wake | Shutdown
FromEngine = Ready | StepOutputs | RequestRefused | Freed | Fatal
Handshake = Hello | Welcome | Reject
Message = ToEngine | FromEngine | Handshake


def as_delta(out: RequestOutput, first: bool = True) -> RequestOutput:
    """What a `StepOutputs` carries of a step's output: the cumulative fields dropped (the
    client accumulates the deltas). After a request's first message the prompt (text and
    ids) is left out too: the client keeps the first message's, and a long prompt
    re-sent every step costs O(prompt) per token."""
    outputs = [CompletionOutput(o.index, "", [], o.finish_reason, o.stop_reason, None,
                                o.delta_text, o.delta_token_ids, o.delta_logprobs)
               for o in out.outputs]      # built directly: `replace` costs ~4x as much
    return RequestOutput(out.request_id, out.prompt if first else None,
                         out.prompt_token_ids if first else [], outputs, out.prompt_logprobs,
                         out.num_cached_tokens, out.finished, out.kv_transfer_params, out.error,
                         out.error_status)
