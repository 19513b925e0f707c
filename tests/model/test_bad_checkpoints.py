"""Every malformed checkpoint gives one clear error naming the file and tensor."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvrelay.model.config import CheckpointError, load_config
from kvrelay.model.loader import load_model, resolve_model_path
from tests.factories import make_hf_model, save_checkpoint


@pytest.fixture()
def ckpt(tmp_path):
    return save_checkpoint(make_hf_model(seed=1), tmp_path / "ckpt")


def _rewrite(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_tensor(ckpt):
    _rewrite(ckpt, lambda t: t.pop("model.layers.1.self_attn.sinks"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.self_attn\.sinks"):
        load_model(ckpt, progress=False)


def test_unexpected_tensor(ckpt):
    _rewrite(ckpt, lambda t: t.update({"model.layers.0.mlp.extra": torch.zeros(2)}))
    with pytest.raises(CheckpointError,
                       match=r"model\.safetensors: unexpected tensor model\.layers\.0\.mlp\.extra"):
        load_model(ckpt, progress=False)


def test_misshaped_tensor_names_file_tensor_and_shapes(ckpt):
    # a transposed expert weight: [E, out, in] instead of transformers' [E, in, out]
    name = "model.layers.0.mlp.experts.gate_up_proj"
    _rewrite(ckpt, lambda t: t.update({name: t[name].transpose(1, 2).contiguous()}))
    with pytest.raises(CheckpointError,
                       match=rf"model\.safetensors: tensor {name} has shape \[4, 192, 64\], "
                             r"expected \[4, 64, 192\]"):
        load_model(ckpt, progress=False)


def test_unknown_model_type(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text()) | {"model_type": "llama"}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: model_type is 'llama'"):
        load_model(ckpt, progress=False)


def test_bad_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: invalid JSON"):
        load_model(ckpt, progress=False)


def test_no_weights(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError,
                       match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        load_model(ckpt, progress=False)


def test_corrupt_safetensors(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError,
                       match=r"model\.safetensors: not a readable safetensors file"):
        load_model(ckpt, progress=False)


def test_sharded_checkpoint_with_missing_shard(tmp_path):
    hf = make_hf_model(seed=2)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert load_model(tmp_path, progress=False).config.num_hidden_layers == 2
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"lists shard {shard.name}, which is missing"):
        load_model(tmp_path, progress=False)


def test_hf_overrides_merge_before_build(ckpt):
    # the tutorial's --hf-overrides '{"quantization_config": {}}' and a real override
    cfg = load_config(ckpt, {"quantization_config": {}, "swiglu_limit": 3.5})
    assert cfg.swiglu_limit == 3.5 and cfg.raw["quantization_config"] == {}


def test_rope_scaling_spelling(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    yarn = cfg.pop("rope_parameters")
    cfg["rope_theta"] = yarn.pop("rope_theta")
    cfg["rope_scaling"] = yarn
    (ckpt / "config.json").write_text(json.dumps(cfg))
    parsed = load_config(ckpt)
    rope = parsed.rope
    assert (rope.rope_type, rope.theta, rope.factor) == ("yarn", 150000.0, 32.0)
    assert parsed.rope.truncate is False


def test_unresolvable_model_id_names_id_and_directory(tmp_path):
    with pytest.raises(CheckpointError,
                       match=r"'openai/gpt-oss-120b' is not a local directory and was not found "
                             rf"in {tmp_path}"):
        resolve_model_path("openai/gpt-oss-120b", download_dir=str(tmp_path))


def test_model_id_found_in_hf_cache_layout(ckpt, tmp_path):
    snap = tmp_path / "hub" / "models--openai--gpt-oss-20b" / "snapshots" / "abc123"
    snap.parent.mkdir(parents=True)
    snap.symlink_to(ckpt)
    assert resolve_model_path("openai/gpt-oss-20b", download_dir=str(tmp_path / "hub")) == snap
