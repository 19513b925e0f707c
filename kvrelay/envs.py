"""Every environment variable that configures kvrelay, typed, in one place.

Each `KVRELAY_X` also answers to the tutorial's (vLLM / Neuron) name, so the
tutorial's exports work unchanged; the KVRELAY_ name wins when both are set.

Not here: variables of other libraries that kvrelay only gives a default when the user
has not set them (UCX_* and NIXL_LOG_LEVEL in disagg/nixl.py, OMP_WAIT_POLICY /
GOMP_SPINCOUNT in cli.py, PATH while the native kernels build, TIKTOKEN_ENCODINGS_BASE
written for openai-harmony), and the environment a launcher copies to its children.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    name: str
    alias: str | None
    default: str | None
    help: str

    def raw(self) -> str | None:
        for key in (self.name, self.alias):
            if key and os.environ.get(key) not in (None, ""):
                return os.environ[key]
        return self.default

    def as_float(self) -> float | None:
        value = self.raw()
        if value is None:
            return None
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{self.shown}: expected a number, got {value!r}") from None

    def as_int(self) -> int | None:
        value = self.as_float()
        return None if value is None else int(value)

    @property
    def shown(self) -> str:
        """How messages name it: both names, so users raise the one they set."""
        return f"{self.alias} (or {self.name})" if self.alias else self.name


SIDE_CHANNEL_HOST = EnvVar("KVRELAY_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_HOST",
                           "127.0.0.1",
                           "listen address of the KV-transfer handshake (prefill side)")
SIDE_CHANNEL_PORT = EnvVar("KVRELAY_NIXL_SIDE_CHANNEL_PORT", "VLLM_NIXL_SIDE_CHANNEL_PORT", "5600",
                           "port of the KV-transfer handshake listener (one per DP rank from here)")
ENGINE_READY_TIMEOUT_S = EnvVar("KVRELAY_ENGINE_READY_TIMEOUT_S", "VLLM_ENGINE_READY_TIMEOUT_S",
                                "600", "seconds allowed from launch until the engine is ready")
EXECUTE_MODEL_TIMEOUT_S = EnvVar("KVRELAY_EXECUTE_MODEL_TIMEOUT_SECONDS",
                                 "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "300",
                                 "seconds one engine step may take before its requests fail")
COMPILATION_TIMEOUT_S = EnvVar("KVRELAY_COMPILATION_TIMEOUT", "VLLM_NEURON_COMPILATION_TIMEOUT",
                               "600", "seconds allowed for warm-up / graph capture / compilation")
KV_LEASE_S = EnvVar("KVRELAY_NIXL_ABORT_REQUEST_TIMEOUT", "VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "120",
                   "seconds a prefill keeps a finished request's KV blocks for a decode read "
                   "that never comes (kv_connector_extra_config.lease_s overrides it)")
VISIBLE_DEVICES = EnvVar("KVRELAY_VISIBLE_DEVICES", "NEURON_VISIBLE_DEVICES", None,
                         "device slice: CPU core ids on CPU, GPU ids on CUDA, e.g. 0-3")
CACHE_DIR = EnvVar("KVRELAY_CACHE_DIR", None, None,
                   "where the embedded model is built and the o200k vocabulary unpacked")
CPU_HALF_MATMUL = EnvVar("KVRELAY_CPU_HALF_MATMUL", None, "auto",
                         "bf16/fp16 weights on CPU: 'native' half-precision GEMMs, 'fp32' (upcast "
                         "the weights per matmul, keep them half in memory) or 'auto' (fp32 unless "
                         "oneDNN has a native bf16 path on this CPU)")
PROXY_API_KEY = EnvVar("KVRELAY_API_KEY", "VLLM_API_KEY", None,
                       "the key clients must present (Authorization: Bearer) to kvrelay proxy; "
                       "--api-key wins")
OPENAI_API_KEY = EnvVar("OPENAI_API_KEY", None, None,
                        "kvrelay proxy's key for its backends, sent only for clients it "
                        "authenticated with --api-key; the default bearer token of "
                        "`kvrelay bench serve` and `kvrelay validate`")
KV_SECRET = EnvVar("KVRELAY_KV_SECRET", None, None,
                   "shared secret of one topology's KV plane: side channel and KV transports "
                   "authenticate peers with it (kvrelay deploy generates one); unset: no "
                   "authentication")
STRUCTURED_ANALYSIS_BUDGET = EnvVar("KVRELAY_STRUCTURED_ANALYSIS_BUDGET", None, "1024",
                                    "harmony + structured outputs: most tokens of the analysis "
                                    "message before the constrained answer at reasoning effort "
                                    "medium (low: a quarter, high: 4x; at most half of "
                                    "max_tokens; a request's thinking_token_budget wins)")
MOE_KERNEL = EnvVar("KVRELAY_MOE_KERNEL", None, "auto",
                    "MoE experts on CPU: 'native' (the C++ kernels built on first use; an error "
                    "if they cannot be built), 'torch' (the pure-PyTorch reference) or 'auto' "
                    "(native where it builds, else torch with one warning; dense experts with "
                    "8+ rows per expert use torch's GEMMs)")
KERNELS_DIR = EnvVar("KVRELAY_KERNELS_DIR", None, None,
                     "where the native CPU kernels are compiled and cached (default "
                     "$XDG_CACHE_HOME/kvrelay/kernels or ~/.cache/kvrelay/kernels; shared by "
                     "every KVRELAY_CACHE_DIR, one build per kvrelay/torch version)")
KERNELS_BUILD = EnvVar("KVRELAY_KERNELS_BUILD", None, "background",
                       "kvrelay serve with no native kernels built yet: 'background' (serve on "
                       "the PyTorch reference paths at once, compile with one job at low "
                       "priority, switch to the kernels between two steps when they are built) "
                       "or 'wait' (compile with every core first, then serve)")
ATTENTION_KERNEL = EnvVar("KVRELAY_ATTENTION_KERNEL", None, "auto",
                          "decode attention on CPU: 'auto' (the C++ paged kernel, built on first "
                          "use; the PyTorch reference path if it cannot be built) or 'reference' "
                          "(also keeps fresh prompts' prefill on the gather path)")

DENSE_KERNEL = EnvVar("KVRELAY_DENSE_KERNEL", None, "auto",
                      "decode-sized matmuls and RMSNorms on CPU: 'auto' (the C++ kernels, built "
                      "on first use, for the row counts where they beat torch on this CPU's "
                      "ISA; PyTorch otherwise) or 'torch' (always the PyTorch reference)")

SCREENED_HEAD = EnvVar("KVRELAY_SCREENED_HEAD", None, "auto",
                       "greedy decode steps on CPU: 'auto' (the LM head's tokens from an int8 "
                       "copy screened with a rigorous bound, only the candidates computed "
                       "exactly: the same tokens, about half the bytes read; where the dense "
                       "kernels run) or 'off' (always the exact LM head)")

CPU_ISA = EnvVar("KVRELAY_CPU_ISA", None, "native",
                 "the best ISA variant the native CPU kernels may use: 'native' (this CPU's "
                 "best), or a cap at 'generic', 'avx2', 'avx512' or 'avx512_bf16' (every kernel "
                 "family then takes its best variant not above it, and the plan's CPU-keyed "
                 "choices follow), to measure a lesser CPU's kernels on this one; a variant "
                 "this CPU cannot run is an error at start-up")

COMPILE_DECODE = EnvVar(
    "KVRELAY_COMPILE_DECODE", None, None,
    "CPU, one rank: padded batch sizes (e.g. '1,2,4,8') whose decode-only steps run the forward "
    "compiled by torch.compile (Inductor: C++ wrapper, frozen weights, max-autotune GEMMs), "
    "compiled during warm-up (~20-70 s per size the first time, then Inductor's disk cache); "
    "a decode-only step pads to the smallest size that fits, other steps run eagerly; "
    "unset: always eager")

ENGINE_KEEP_FREED_MEMORY = EnvVar(
    "KVRELAY_ENGINE_KEEP_FREED_MEMORY", None, "1",
    "after loading, the engine core keeps freed memory for reuse (glibc: no fresh mapping per "
    "large block, no trimming) so per-step tensors do not fault in fresh pages: '1' (default) "
    "or '0' (freed memory goes back to the system)")

STEP_TRACE = EnvVar(
    "KVRELAY_STEP_TRACE", None, None,
    "a file the engine core appends one line per step to (monotonic seconds: step start, step "
    "end, outputs sent; outputs in the step), for benchmarks/serve_overhead.py; unset: none")

SINGLE_THREAD_STEP_MACS = EnvVar(
    "KVRELAY_SINGLE_THREAD_STEP_MACS", None, "16e6",
    "CPU: a step under this many multiply-adds runs on one thread (intra-op parallelism of "
    "small ops costs more in barriers than it saves, and collapses when cores are shared); "
    "0: never")


def parse_id_list(text: str) -> list[int]:
    """"0-3,6" → [0, 1, 2, 3, 6] (the NEURON_VISIBLE_DEVICES syntax)."""
    ids: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            start, stop = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"bad device list {text!r}: expected ids and ranges like "
                             "0-3,6") from None
        if stop < start:
            raise ValueError(f"bad device list {text!r}: range {part} is descending")
        ids.extend(range(start, stop + 1))
    return ids


# -- the Responses API store (kvrelay/server/response_store.py, response_sqlite.py)
RESPONSES_STORE = EnvVar("KVRELAY_ENABLE_RESPONSES_API_STORE", "VLLM_ENABLE_RESPONSES_API_STORE",
                         "1", "0: /v1/responses keeps nothing (no store, previous_response_id or "
                         "GET); on by default here (vLLM's default is off)")
RESPONSES_STORE_MAX_ENTRIES = EnvVar("KVRELAY_RESPONSES_STORE_MAX_ENTRIES", None, "1000",
                                     "responses kept in memory; the least recently used are "
                                     "evicted first")
RESPONSES_STORE_MAX_BYTES = EnvVar("KVRELAY_RESPONSES_STORE_MAX_BYTES", None, str(256 << 20),
                                   "bytes all stored responses may take (their JSON); the least "
                                   "recently used are evicted first")
RESPONSES_STORE_MAX_ENTRY_BYTES = EnvVar("KVRELAY_RESPONSES_STORE_MAX_ENTRY_BYTES", None,
                                         str(16 << 20), "bytes one stored response may take; a "
                                         "larger one is answered but not kept")
TOOL_SERVER_MAX_OUTPUT_BYTES = EnvVar(
    "KVRELAY_TOOL_SERVER_MAX_OUTPUT_BYTES", None, str(64 << 10),
    "bytes of one MCP tool result fed back to the model in /v1/responses (longer: cut, the "
    "cut said in the text); --tool-server-max-output-bytes wins")
STATE_DIR = EnvVar("KVRELAY_STATE_DIR", None, None,
                   "where kvrelay serve keeps state across restarts (the responses store, "
                   "--responses-store sqlite); --state-dir wins (default "
                   "$KVRELAY_CACHE_DIR/state, else ~/.cache/kvrelay/state)")

# -- where things are cached on disk
XDG_CACHE_HOME = EnvVar("XDG_CACHE_HOME", None, None,
                        "the user's cache folder (default ~/.cache); kvrelay's caches go under "
                        "its kvrelay/ unless KVRELAY_CACHE_DIR / KVRELAY_KERNELS_DIR say otherwise")
HF_HUB_CACHE = EnvVar("HF_HUB_CACHE", None, None,
                      "Hugging Face hub cache searched for a --model given as a repo id "
                      "(default $HF_HOME/hub); kvrelay never downloads")
HF_HOME = EnvVar("HF_HOME", None, "~/.cache/huggingface", "Hugging Face home (see HF_HUB_CACHE)")
# -- disaggregation
SIDE_CHANNEL_ADVERTISE_HOST = EnvVar(
    "KVRELAY_SIDE_CHANNEL_ADVERTISE_HOST", None, None,
    "the host a prefill server puts in kv_transfer_params for decode servers to reach its side "
    "channel (default: the bind host, or the default route's IP for a wildcard bind)")

# -- KV cache events (kvrelay/kv_events/)
KV_EVENTS_INT_HASHES = EnvVar(
    "KVRELAY_KV_EVENTS_USE_INT_BLOCK_HASHES", "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1",
    "KV cache events (--kv-events-config): 1 publishes block hashes as vLLM does by default, the "
    "unsigned 64-bit integer of the SHA-256 digest's last 8 bytes (big-endian); 0 the 32 bytes")
KV_EVENTS_ENCODING = EnvVar(
    "KVRELAY_KV_EVENTS_ENCODING", None, "map",
    "KV cache events: 'map' (default) encodes each event as a tagged map, as vLLM after 0.23 does; "
    "'array' as the positional arrays of vLLM <= 0.23, for subscribers that read only those")


def user_cache_dir() -> Path:
    """$XDG_CACHE_HOME, else ~/.cache."""
    xdg = XDG_CACHE_HOME.raw()
    return Path(xdg).expanduser() if xdg else Path.home() / ".cache"


# -- Ray (--distributed-executor-backend ray / --data-parallel-backend ray)
RAY_ADDRESS = EnvVar("RAY_ADDRESS", None, None,
                     "the Ray cluster that --distributed-executor-backend ray / "
                     "--data-parallel-backend ray join (--ray-address wins); unset: a cluster "
                     "started on this host with `ray start --head`. kvrelay never starts one")
RAY_CPUS_PER_WORKER = EnvVar("KVRELAY_RAY_CPUS_PER_WORKER", None, "1",
                             "Ray CPUs reserved per tensor-parallel rank placed by Ray (a "
                             "data-parallel replica reserves TP × this); the rank runs that many "
                             "torch threads")
RAY_PLACEMENT_TIMEOUT_S = EnvVar("KVRELAY_RAY_PLACEMENT_TIMEOUT_S", None, "120",
                                 "seconds Ray may take to place a server's ranks or replicas "
                                 "before the server gives up with the resources it asked for")


def kvrelay_cache_dir() -> Path:
    """$KVRELAY_CACHE_DIR, else $XDG_CACHE_HOME/kvrelay, else ~/.cache/kvrelay."""
    explicit = CACHE_DIR.raw()
    return Path(explicit).expanduser() if explicit else user_cache_dir() / "kvrelay"


def state_dir() -> Path:
    """$KVRELAY_STATE_DIR, else the kvrelay cache directory's state/."""
    explicit = STATE_DIR.raw()
    return Path(explicit).expanduser() if explicit else kvrelay_cache_dir() / "state"


# every variable above, for docs and checks (computed, so additions never collide)
ALL = tuple(v for v in list(globals().values()) if isinstance(v, EnvVar))
