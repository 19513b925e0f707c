"""Loading materialises each weight once: MXFP4 experts are views of the mapped checkpoint
and the pages of copied weights leave the process, so peak RSS stays near the file size."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvrelay.model.config import load_config
from kvrelay.model.loader import INDEX_FILE, expected_tensors, load_model

# ~160 MB, ~37% of it dense bf16 in many similar-sized tensors (gpt-oss-20b: ~27%,
# the rest MXFP4 experts)
CONFIG = {"vocab_size": 4096, "hidden_size": 1024, "intermediate_size": 1024, "head_dim": 64,
          "num_attention_heads": 16, "num_key_value_heads": 4, "num_hidden_layers": 8,
          "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 16,
          "max_position_embeddings": 256}


@pytest.fixture(scope="module")
def mxfp4_ckpt(tmp_path_factory) -> Path:
    from transformers import GptOssConfig
    path = tmp_path_factory.mktemp("mxfp4_ckpt")
    GptOssConfig(**CONFIG).save_pretrained(path)
    shapes = expected_tensors(load_config(path), mxfp4_on_disk=True)
    gen = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    for name, shape in sorted(shapes.items()):
        if name.endswith("_blocks"):
            t = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        elif name.endswith("_scales"):
            t = torch.full(shape, 120, dtype=torch.uint8)
        else:
            t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        shards[any(f".layers.{i}." in name for i in (4, 5, 6, 7)) or "lm_head" in name][name] = t
    weight_map = {}
    for k, tensors in enumerate(shards):
        file = f"model-{k:05d}-of-00002.safetensors"
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file)
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def _mapped_file(address: int) -> str | None:
    """The file backing `address` in this process's memory map (None: anonymous memory)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            return fields[5] if len(fields) == 6 else None
    return None


def test_mxfp4_experts_are_views_of_the_checkpoint_and_values_unchanged(mxfp4_ckpt):
    loaded = load_model(mxfp4_ckpt, progress=False)
    experts = loaded.model.layers[5].mlp.experts
    for w in (experts.gate_up, experts.down):
        backing = _mapped_file(w.blocks.data_ptr())
        assert backing is not None and backing.endswith("model-00001-of-00002.safetensors"), backing
    on_disk = load_file(str(mxfp4_ckpt / "model-00001-of-00002.safetensors"))
    prefix = "model.layers.5.mlp.experts"
    assert torch.equal(experts.gate_up.blocks, on_disk[f"{prefix}.gate_up_proj_blocks"])
    assert torch.equal(experts.down.scales, on_disk[f"{prefix}.down_proj_scales"])
    # dense weights are copies in the model dtype: same values as the file
    assert torch.equal(loaded.model.lm_head.weight, on_disk["lm_head.weight"])


def _resident_bytes(file_name: str) -> int:
    """Bytes of `file_name`'s mappings resident in this process (/proc/self/smaps Rss)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:   # a mapping's header
            inside = len(fields) == 6 and fields[5].endswith(file_name)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def test_mxfp4_experts_are_resident_once_loaded(mxfp4_ckpt):
    """The experts stay views of the file, mapped in at load: the first request reads no
    page of them from disk (a 20b-shaped server's first 200-token prompt took 21 s
    faulting its 12 GB of experts in a page at a time, against ~2.6 s once resident)."""
    file = "model-00001-of-00002.safetensors"
    experts = sum(t.numel() for t in load_file(str(mxfp4_ckpt / file)).values()
                  if t.dtype == torch.uint8)
    loaded = load_model(mxfp4_ckpt, progress=False)
    assert _resident_bytes(file) >= experts, (_resident_bytes(file), experts)
    del loaded


PEAK_RSS_SCRIPT = textwrap.dedent("""
    import sys, torch
    from kvrelay.model.loader import load_model
    def kb(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    before = kb("VmRSS")
    model = load_model(sys.argv[1], progress=False).model
    print(kb("VmHWM") - before)
""")


def test_loading_peak_rss_counts_each_dense_weight_once(mxfp4_ckpt):
    size = sum(f.stat().st_size for f in mxfp4_ckpt.glob("*.safetensors"))
    dense = sum(t.numel() * t.element_size() for f in mxfp4_ckpt.glob("*.safetensors")
                for t in load_file(str(f)).values() if t.dtype != torch.uint8)
    out = subprocess.run([sys.executable, "-c", PEAK_RSS_SCRIPT, str(mxfp4_ckpt)],
                         capture_output=True, text=True, timeout=300, check=True)
    growth = int(out.stdout.split()[-1])
    experts = size - dense      # mapped in at load (shared with the page cache), not copied
    # The MXFP4 experts are views of the mapped file (mapped in at load); each dense weight
    # is copied into its parameter. Before, the file pages each copy was read from stayed
    # mapped into the process to the end (growth: the experts + 2x the dense bytes); now
    # they are dropped after each layer, so only the largest tensor's pages add up.
    assert growth <= experts + dense + 0.2 * dense, (
        f"loading grew RSS by {growth / 2**20:.0f} MiB for {dense / 2**20:.0f} MiB of dense "
        f"weights in a {size / 2**20:.0f} MiB checkpoint")
