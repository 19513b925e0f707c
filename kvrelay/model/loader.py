"""Load a gpt-oss checkpoint (safetensors, single file or sharded) into `GptOssModel`.

Checks the whole checkpoint against the config *before* reading any weights, so a
malformed checkpoint fails with one message naming the file and tensor:
missing, unexpected or mis-shaped tensors, unknown model_type, bad JSON.

MXFP4 vs dense experts is decided by the tensor names on disk (`*_blocks`/`*_scales`),
never by `quantization_config` — the tutorial clears that with `--hf-overrides`
while the tensors stay MXFP4. MXFP4 experts stay packed in memory unless dense
experts are asked for (`quantization=None` on an MXFP4 checkpoint dequantises at load).

Weights are materialised once: the shards are memory-mapped, packed experts stay views of
the mapping (page cache), dense weights are copied into their parameters and the pages
they were copied from are dropped from the process after each layer.
"""
from __future__ import annotations

import json
import logging
import mmap
import struct
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from kvrelay.model.config import CheckpointError, GptOssConfig, load_config
from kvrelay.model.execution_plan import ExecutionPlan
from kvrelay.model.gpt_oss import DecoderLayer, GptOssModel
from kvrelay.model.mxfp4 import BLOCK, MXFP4Tensor
from kvrelay.model.parallel import ParallelContext

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


# safetensors dtype names → torch dtypes (the ones a gpt-oss checkpoint can hold)
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
           "F64": torch.float64, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
           "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}
_PAGE = mmap.PAGESIZE
# madvise(2): map a range's pages in now, reading them from the file where the page cache
# lacks them (Linux 5.14); on older kernels MADV_WILLNEED starts the same reads in the
# background and the first touch of each page is a minor fault instead.
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


class _MappedFile:
    """One safetensors file mapped copy-on-write; tensors are zero-copy views of the map.

    MAP_PRIVATE keeps the views writable (torch wants writable buffers) while the file on
    disk is never modified; pages not written to stay shared with the page cache.
    """

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            header_len = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(header_len))
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        header.pop("__metadata__", None)
        self.data_start = 8 + header_len
        self.address = torch.frombuffer(self.map, dtype=torch.uint8, count=1).data_ptr()
        unknown = sorted({e["dtype"] for e in header.values()} - set(_DTYPES))
        if unknown:
            raise CheckpointError(f"{path}: unsupported tensor dtype {unknown[0]}")
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {
            name: (_DTYPES[e["dtype"]], tuple(e["shape"]), *e["data_offsets"])
            for name, e in header.items()}

    def view(self, name: str) -> tuple[torch.Tensor, int, int]:
        """The tensor as a view of the map, and its byte range in the file."""
        dtype, shape, begin, end = self.entries[name]
        start = self.data_start + begin
        if end == begin:
            return torch.empty(shape, dtype=dtype), start, start
        raw = torch.frombuffer(self.map, dtype=torch.uint8, count=end - begin, offset=start)
        return raw.view(dtype).view(shape), start, start + end - begin

    def populate(self, start: int, stop: int) -> None:
        """Map [start, stop) of the file into this process now (read from disk if needed)."""
        lo, hi = start // _PAGE * _PAGE, min(-(-stop // _PAGE) * _PAGE, len(self.map))
        if hi <= lo:
            return
        try:
            self.map.madvise(_POPULATE_READ, lo, hi - lo)
        except OSError:
            self.map.madvise(mmap.MADV_WILLNEED, lo, hi - lo)

    def release(self, start: int, stop: int) -> None:
        """Drop the pages of [start, stop) from this process (the page cache keeps them):
        a view of them that is still alive reads them back from the file on next use.
        Writes made through a view are dropped too: loaded views are only ever read."""
        lo, hi = start // _PAGE * _PAGE, -(-stop // _PAGE) * _PAGE
        if hi > lo:
            self.map.madvise(mmap.MADV_DONTNEED, lo, min(hi, len(self.map)) - lo)


class SafetensorsWeights:
    """A WeightSource over a checkpoint directory; reads only the requested slices.

    `get` returns zero-copy views of the memory-mapped files, so a weight is materialised
    once: either copied into its parameter (dense weights) or kept as the view itself
    (packed MXFP4 experts, which then live in the page cache, shared between ranks).
    A copied weight's file pages would otherwise stay mapped into the process — counted
    in its RSS a second time — so the loader calls `release()` after each part it loads.
    """

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        self.file_of = _tensor_files(self.model_dir)
        self._handles: dict[str, Any] = {}
        self._maps: dict[str, _MappedFile] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._handed_out: list[tuple[str, int, int]] = []
        for name, file in self.file_of.items():
            self._shapes[name] = tuple(self._open(file).get_slice(name).get_shape())

    def _open(self, file: str) -> Any:
        """safetensors' own reader validates the file (header, offsets, length) once."""
        if file not in self._handles:
            path = self.model_dir / file
            try:
                self._handles[file] = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises several error types
                raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
        return self._handles[file]

    def _mapped(self, file: str) -> _MappedFile:
        if file not in self._maps:
            self._open(file)
            self._maps[file] = _MappedFile(self.model_dir / file)
        return self._maps[file]

    def names(self) -> set[str]:
        return set(self.file_of)

    def has(self, name: str) -> bool:
        return name in self.file_of

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def get(self, name: str, dim: int | None = None, start: int = 0,
            stop: int | None = None) -> torch.Tensor:
        file = self.file_of[name]
        tensor, lo, hi = self._mapped(file).view(name)
        self._handed_out.append((file, lo, hi))
        if dim is None:
            return tensor
        length = (tensor.shape[dim] if stop is None else min(stop, tensor.shape[dim])) - start
        return tensor.narrow(dim, start, max(length, 0))

    def populate(self, tensors: Iterable[torch.Tensor]) -> int:
        """Map in now the pages of those `tensors` that are views of the files (the weights
        kept as views: packed MXFP4 experts), so the first request does not fault them in
        from disk a page at a time. Returns the bytes so mapped."""
        done = 0
        for t in tensors:
            if t.numel() == 0:
                continue
            # the view's own bytes (a rank's experts of a file's tensor, not the whole tensor)
            ptr = t.data_ptr()
            n = (1 + sum((d - 1) * st for d, st in zip(t.shape, t.stride(), strict=True))) \
                * t.element_size()
            for m in self._maps.values():
                if m.address <= ptr < m.address + len(m.map):
                    m.populate(ptr - m.address, ptr - m.address + n)
                    done += n
                    break
        return done

    def release(self) -> None:
        """Unmap the pages of every tensor handed out since the last call."""
        for file, lo, hi in self._handed_out:
            self._maps[file].release(lo, hi)
        self._handed_out.clear()


def _tensor_files(model_dir: Path) -> dict[str, str]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: malformed index ({e})") from None
        for file in set(weight_map.values()):
            if not (model_dir / file).is_file():
                raise CheckpointError(f"{index}: lists shard {file}, which is missing")
        return dict(weight_map)
    single = model_dir / SINGLE_FILE
    if single.is_file():
        try:
            with safe_open(str(single), framework="pt") as f:
                return dict.fromkeys(f.keys(), SINGLE_FILE)
        except Exception as e:
            raise CheckpointError(f"{single}: not a readable safetensors file ({e})") from None
    raise CheckpointError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE} found")


def expected_tensors(c: GptOssConfig, mxfp4_on_disk: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor name of a gpt-oss checkpoint with its shape."""
    H, I, E, hd = c.hidden_size, c.intermediate_size, c.num_local_experts, c.head_dim  # noqa: E741
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, H),
        "model.norm.weight": (H,),
        "lm_head.weight": (c.vocab_size, H),
    }
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (H,), f"{p}.post_attention_layernorm.weight": (H,),
            f"{p}.self_attn.q_proj.weight": (q, H), f"{p}.self_attn.q_proj.bias": (q,),
            f"{p}.self_attn.k_proj.weight": (kv, H), f"{p}.self_attn.k_proj.bias": (kv,),
            f"{p}.self_attn.v_proj.weight": (kv, H), f"{p}.self_attn.v_proj.bias": (kv,),
            f"{p}.self_attn.o_proj.weight": (H, q), f"{p}.self_attn.o_proj.bias": (H,),
            f"{p}.self_attn.sinks": (c.num_attention_heads,),
            f"{p}.mlp.router.weight": (E, H), f"{p}.mlp.router.bias": (E,),
            f"{p}.mlp.experts.gate_up_proj_bias": (E, 2 * I),
            f"{p}.mlp.experts.down_proj_bias": (E, H),
        }
        x = f"{p}.mlp.experts"
        if mxfp4_on_disk:
            shapes |= {
                f"{x}.gate_up_proj_blocks": (E, 2 * I, H // BLOCK, BLOCK // 2),
                f"{x}.gate_up_proj_scales": (E, 2 * I, H // BLOCK),
                f"{x}.down_proj_blocks": (E, H, I // BLOCK, BLOCK // 2),
                f"{x}.down_proj_scales": (E, H, I // BLOCK),
            }
        else:
            shapes |= {f"{x}.gate_up_proj": (E, H, 2 * I), f"{x}.down_proj": (E, I, H)}
    return shapes


def check_checkpoint(src: SafetensorsWeights, config: GptOssConfig) -> bool:
    """Validate names and shapes; returns whether the experts are MXFP4 on disk."""
    mxfp4 = any(n.endswith("_blocks") for n in src.names())
    expected = expected_tensors(config, mxfp4)
    present = src.names()
    missing = sorted(set(expected) - present)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{src.model_dir}: missing tensor {missing[0]}{more}")
    unexpected = sorted(present - set(expected))
    if unexpected:
        name = unexpected[0]
        raise CheckpointError(f"{src.model_dir / src.file_of[name]}: unexpected tensor {name}")
    for name, shape in expected.items():
        if src.shape(name) != shape:
            raise CheckpointError(
                f"{src.model_dir / src.file_of[name]}: tensor {name} has shape "
                f"{list(src.shape(name))}, expected {list(shape)} from config.json")
    return mxfp4


@dataclass(frozen=True)
class LoadedModel:
    model: GptOssModel
    config: GptOssConfig
    mxfp4_on_disk: bool
    weight_bytes: int


def load_model(model_dir: str | Path, *, dtype: torch.dtype = torch.bfloat16,
               quantization: str | None = "auto", hf_overrides: dict[str, Any] | None = None,
               ctx: ParallelContext | None = None, device: str | torch.device = "cpu",
               hybrid_kv_cache: bool = True, max_positions: int | None = None,
               progress: bool = True, config: GptOssConfig | None = None,
               plan: ExecutionPlan | None = None) -> LoadedModel:
    """Build the model for one rank and read its shard of the weights.

    quantization: "auto" keeps MXFP4 checkpoints packed and dense ones dense; "mxfp4"
    requires MXFP4 experts on disk; None dequantises MXFP4 experts at load.
    config: the checkpoint's parsed config.json when the caller has it (EngineConfig).
    plan: the model's execution plan (default: this process's, `execution_plan.current()`).
    """
    start = time.perf_counter()
    model_dir = Path(model_dir)
    if config is None:
        config = load_config(model_dir, hf_overrides)
    src = SafetensorsWeights(model_dir)
    mxfp4_on_disk = check_checkpoint(src, config)
    if quantization not in ("auto", "mxfp4", None):
        raise ValueError(f"unknown quantization {quantization!r}: expected 'mxfp4' or none")
    if quantization == "mxfp4" and not mxfp4_on_disk:
        raise CheckpointError(f"{model_dir}: quantization 'mxfp4' needs MXFP4 expert tensors "
                              f"(*_blocks/*_scales); this checkpoint stores dense experts")
    packed = mxfp4_on_disk and quantization in ("auto", "mxfp4")
    with torch.no_grad():
        model = GptOssModel(config, ctx, dtype, packed, hybrid_kv_cache, max_positions, plan)
        _load_with_progress(model, src, progress)
        model.to(device)
    model.eval()
    nbytes = model.weight_bytes()
    logger.info("loaded %s: %d layers, %s experts, %.1f MiB of weights on %s in %.1f s",
                model_dir, config.num_hidden_layers,
                "MXFP4" if packed else str(dtype).replace("torch.", ""), nbytes / 2**20, device,
                time.perf_counter() - start)
    return LoadedModel(model, config, mxfp4_on_disk, nbytes)


def _load_with_progress(model: GptOssModel, src: SafetensorsWeights, progress: bool) -> None:
    steps = len(model.layers) + 2
    if progress:        # a line for logs (kvrelay deploy reads it), the bar for a terminal
        logger.info("Loading weights: %d parts from %s", steps, src.model_dir)
    bar = tqdm(total=steps, desc="Loading weights", unit="part",
               disable=None if progress else True, leave=False)   # None: on a terminal only
    with bar:
        model.embed_tokens.load(src, "model.embed_tokens.weight")
        src.release()
        bar.update()
        for i, layer in enumerate(cast("list[DecoderLayer]", model.layers)):
            layer.load(src, f"model.layers.{i}")
            src.release()
            bar.update()
        model.norm.weight.copy_(src.get("model.norm.weight"))
        model.lm_head.load(src, "lm_head.weight")
        src.release()
        bar.update()
    start = time.perf_counter()
    mapped = src.populate(_weight_tensors(model))
    if mapped:
        logger.info("weights kept in the checkpoint's files: %.1f MiB mapped in %.1f s",
                    mapped / 2**20, time.perf_counter() - start)


def _weight_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor the model computes with: parameters, buffers and packed MXFP4 weights."""
    yield from model.parameters()
    yield from model.buffers()
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, MXFP4Tensor):
                yield value.blocks
                yield value.scales


def resolve_model_path(model: str, download_dir: str | None = None) -> Path:
    """A local directory, or a Hugging Face repo id found in the HF cache layout
    (`<cache>/models--org--name/snapshots/<rev>/`). Never downloads (kvrelay/model/locate.py)."""
    from kvrelay.model.locate import locate_checkpoint
    return locate_checkpoint(model, download_dir)
