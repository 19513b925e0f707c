"""The messages between the API process and an engine core (and the data-parallel
handshake), and their one JSON codec.

    API process ──AddRequest | AbortRequests | FreeRemote | Wake | Shutdown──▶ engine core
    API process ◀──Ready | StepOutputs | RequestRefused | Freed | Fatal────── engine core

On this node the messages cross a `multiprocessing` pipe as they are (pickled
dataclasses); to a replica on a headless node (`engine/dp_remote.py`) they cross TCP as
JSON frames made by `to_wire` / `from_wire` (never pickle over the network):

    {"type": <message tag>, "replica": <data-parallel rank>, ...the message's fields}

`StepOutputs` carries only what changed in the step (new token ids, new text, new
logprobs), never tensors; `EngineStats` is the core's snapshot after that step, and
`EngineInfo` what it resolved once at start-up.

This module imports no torch, so the API process can use it without loading a model.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, ClassVar

from kvrelay.engine.outputs import CompletionOutput, PicklesAsTuple, RequestOutput
from kvrelay.engine.request import Logprob
from kvrelay.sampling_params import SamplingParams


class _Record(Mapping[str, Any]):
    """A frozen dataclass that also reads as a mapping of its (non-None) fields, for the
    readers that take the engine's numbers by name (Prometheus metrics, the launcher)."""

    def _items(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)  # type: ignore[arg-type]
                if getattr(self, f.name) is not None}

    def __getitem__(self, key: str) -> Any:
        return self._items()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._items())


# -- what an engine core reports ------------------------------------------------------------
@dataclass(frozen=True, eq=True)
class EngineStats(PicklesAsTuple, _Record):
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

    def __post_init__(self) -> None:
        per_pos = self.spec_decode_accepted_per_pos
        if per_pos is not None and not isinstance(per_pos, tuple):     # a JSON frame's list
            object.__setattr__(self, "spec_decode_accepted_per_pos", tuple(per_pos))

    @classmethod
    def total(cls, replicas: list[EngineStats]) -> EngineStats:
        """The data-parallel sum: counters add up (per position, too); the KV usage is the
        replicas' mean."""
        if not replicas:
            return cls()
        summed: dict[str, Any] = {}
        for f in fields(cls):
            values = [getattr(s, f.name) for s in replicas if getattr(s, f.name) is not None]
            summed[f.name] = _sum(values) if values else None
        summed["kv_cache_usage_perc"] /= len(replicas)
        return cls(**summed)


def _sum(values: list[Any]) -> Any:
    """Numbers added; tuples of counts added position by position."""
    if not isinstance(values[0], tuple):
        return sum(values)
    width = max(len(v) for v in values)
    return tuple(sum(v[j] for v in values if j < len(v)) for j in range(width))


@dataclass(frozen=True)
class EngineInfo(_Record):
    """What the engine core resolved at start-up (sent with `Ready`; again, with a second
    `Ready`, when the native kernels built in the background switch in)."""

    max_model_len: int
    model_dir: str
    pid: int
    vocab_size: int
    kv_cache_spec: dict[str, Any] = field(default_factory=dict)
    native: dict[str, Any] = field(default_factory=dict)   # CPU kernels / matmul path in use



# -- API process → engine core ----------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    tag: ClassVar[str] = "add"
    request_id: str
    prompt: list[int]
    params: SamplingParams
    kv_transfer_params: dict[str, Any] | None = None


@dataclass(frozen=True)
class AbortRequests:
    tag: ClassVar[str] = "abort"
    request_ids: list[str]


@dataclass(frozen=True)
class FreeRemote:
    """Free the blocks a prefill holds for a decode under `request_id` if `capability`
    is the one they were held with; answered by `Freed` with the same `token`."""

    tag: ClassVar[str] = "free_remote"
    request_id: str
    capability: str
    token: int


@dataclass(frozen=True)
class Wake:
    """Lockstep replicas (`engine/lockstep.py`): a request was added somewhere (wave n)."""

    tag: ClassVar[str] = "wake"
    wave: int


@dataclass(frozen=True)
class Shutdown:
    tag: ClassVar[str] = "shutdown"


# -- engine core → API process ----------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    tag: ClassVar[str] = "ready"
    info: EngineInfo
    stats: EngineStats


@dataclass(frozen=True)
class StepOutputs:
    """One step's deltas (possibly none: a stats-only update) and the stats after it."""

    tag: ClassVar[str] = "outputs"
    outputs: list[RequestOutput]
    stats: EngineStats


@dataclass(frozen=True)
class RequestRefused:
    """The core did not add a request: status 400 the request is invalid (`param` names
    the field), 500 adding it raised anything else (nothing of it stays in the engine)."""

    tag: ClassVar[str] = "error"
    request_id: str
    message: str
    status: int = 400
    param: str | None = None


@dataclass(frozen=True)
class Freed:
    tag: ClassVar[str] = "freed"
    token: int
    freed: bool


@dataclass(frozen=True)
class Fatal:
    """The core failed to start, or its shared state broke: it ends."""

    tag: ClassVar[str] = "fatal"
    reason: str


# -- the data-parallel head ⇄ headless node handshake (engine/dp_remote.py) -----------------
@dataclass(frozen=True)
class Layout:
    """What a head and its headless nodes must agree on."""

    data_parallel_size: int
    tensor_parallel_size: int
    enable_expert_parallel: bool
    model_config: str              # a hash of the model's config.json


@dataclass(frozen=True)
class Hello:
    """A headless node's first frame: its layout and the replica ranks it runs."""

    tag: ClassVar[str] = "hello"
    version: int
    layout: Layout
    start_rank: int
    local_size: int


@dataclass(frozen=True)
class Welcome:
    tag: ClassVar[str] = "welcome"
    master_port: int | None        # the expert world's port (experts across replicas)


@dataclass(frozen=True)
class Reject:
    tag: ClassVar[str] = "reject"
    error: str


ToEngine = AddRequest | AbortRequests | FreeRemote | Wake | Shutdown
FromEngine = Ready | StepOutputs | RequestRefused | Freed | Fatal
Handshake = Hello | Welcome | Reject
Message = ToEngine | FromEngine | Handshake
TO_ENGINE = (AddRequest, AbortRequests, FreeRemote, Wake, Shutdown)
FROM_ENGINE = (Ready, StepOutputs, RequestRefused, Freed, Fatal)

MESSAGE_TYPES: dict[str, type[Message]] = {
    m.tag: m for m in TO_ENGINE + FROM_ENGINE + (Hello, Welcome, Reject)}


def as_delta(out: RequestOutput, first: bool = True) -> RequestOutput:
    """What a `StepOutputs` carries of a step's output: the cumulative fields dropped (the
    client accumulates the deltas). After a request's first message the prompt (text and
    ids) is left out too: the client keeps the first message's, and a long prompt
    re-pickled every step costs O(prompt) per token."""
    outputs = [CompletionOutput(o.index, "", [], o.finish_reason, o.stop_reason, None,
                                o.delta_text, o.delta_token_ids, o.delta_logprobs)
               for o in out.outputs]      # built directly: `replace` costs ~4x as much
    return RequestOutput(out.request_id, out.prompt if first else None,
                         out.prompt_token_ids if first else [], outputs, out.prompt_logprobs,
                         out.num_cached_tokens, out.finished, out.kv_transfer_params, out.error,
                         out.error_status)


class CodecError(ValueError):
    """A JSON frame that is no engine message (unknown type, missing or wrong fields)."""


# -- the JSON codec ---------------------------------------------------------------------------
def to_wire(message: Message) -> dict[str, Any]:
    """A message → a JSON-able object with its tag as "type"."""
    if isinstance(message, AddRequest):
        if message.params.logits_processors:
            raise ValueError("per-request logits processors cannot be sent to a replica on "
                             "another node")
        body: dict[str, Any] = {"request_id": message.request_id, "prompt": list(message.prompt),
                                "params": _params_out(message.params),
                                "kv_transfer_params": message.kv_transfer_params}
    elif isinstance(message, StepOutputs):
        body = {"outputs": [_output_out(o) for o in message.outputs],
                "stats": asdict(message.stats)}
    elif isinstance(message, Ready):
        body = {"info": asdict(message.info), "stats": asdict(message.stats)}
    elif type(message) in MESSAGE_TYPES.values():
        body = asdict(message)
    else:
        raise ValueError(f"not an engine message: {type(message).__name__}")
    return {"type": message.tag, **body}


def from_wire(frame: dict[str, Any]) -> Message:
    """The inverse of `to_wire`; keys other than the message's fields (e.g. the replica
    rank) are ignored. CodecError when the frame is no engine message."""
    cls = MESSAGE_TYPES.get(frame.get("type"))  # type: ignore[arg-type]
    if cls is None:
        raise CodecError(f"unknown message type {frame.get('type')!r}")
    body = {f.name: frame[f.name] for f in fields(cls) if f.name in frame}
    try:
        if cls is AddRequest:
            body["prompt"] = [int(t) for t in body["prompt"]]
            body["params"] = SamplingParams(**body["params"])
        elif cls is StepOutputs:
            body["outputs"] = [_output_in(o) for o in body["outputs"]]
            body["stats"] = EngineStats(**body["stats"])
        elif cls is Ready:
            body["info"], body["stats"] = EngineInfo(**body["info"]), EngineStats(**body["stats"])
        elif cls is Hello:
            body["layout"] = Layout(**body["layout"])
            body["start_rank"] = int(body["start_rank"])
            body["local_size"] = int(body["local_size"])
        return cls(**body)
    except (KeyError, TypeError) as e:
        raise CodecError(f"malformed {frame['type']!r} message: {type(e).__name__}: {e}") from None


_PARAM_FIELDS = [f.name for f in fields(SamplingParams) if f.name != "logits_processors"]


def _params_out(params: SamplingParams) -> dict[str, Any]:
    """SamplingParams → JSON (structured_outputs as its dict; `SamplingParams(**d)` reads it)."""
    d = {k: getattr(params, k) for k in _PARAM_FIELDS}
    if params.structured_outputs is not None:
        d["structured_outputs"] = params.structured_outputs.to_dict()
    return d


def _logprobs_out(lps: list | None) -> list | None:
    if lps is None:
        return None
    return [None if d is None else [[lp.token_id, lp.logprob, lp.rank] for lp in d.values()]
            for d in lps]


def _logprobs_in(lps: list | None) -> list | None:
    if lps is None:
        return None
    return [None if d is None else {int(t): Logprob(int(t), float(p), int(r)) for t, p, r in d}
            for d in lps]


def _output_out(o: RequestOutput) -> dict[str, Any]:
    d = asdict(replace(o, outputs=[], prompt_logprobs=None))
    d["outputs"] = [{**asdict(replace(c, logprobs=None, delta_logprobs=None)),
                     "logprobs": _logprobs_out(c.logprobs),
                     "delta_logprobs": _logprobs_out(c.delta_logprobs)} for c in o.outputs]
    d["prompt_logprobs"] = _logprobs_out(o.prompt_logprobs)
    return d


def _output_in(d: dict[str, Any]) -> RequestOutput:
    outputs = [CompletionOutput(**{**c, "logprobs": _logprobs_in(c["logprobs"]),
                                   "delta_logprobs": _logprobs_in(c["delta_logprobs"])})
               for c in d["outputs"]]
    return RequestOutput(**{**d, "outputs": outputs,
                            "prompt_logprobs": _logprobs_in(d["prompt_logprobs"])})
