"""EngineArgs → EngineConfig: resolved once, validated, with the one EP-width rule.

Only config.json is needed to resolve (no weights are read), so these run on a
hand-written checkpoint directory.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrelay.config import EngineArgs, EngineConfig, ExpertLayout

# 8 heads, 2 KV heads, 4 experts: TP 2 and EP 2/4 fit; TP 3 and EP 8 do not
CONFIG = {"model_type": "gpt_oss", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 32,
          "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
          "head_dim": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
          "sliding_window": 8, "max_position_embeddings": 512, "torch_dtype": "float16"}


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return tmp_path


def resolve(ckpt: Path, **kwargs) -> EngineConfig:
    return EngineConfig.from_args(EngineArgs(model=str(ckpt), **kwargs))


@pytest.mark.parametrize("tp, dp, ep, degree, inner, width, across", [
    (4, 1, False, None, 1, 1, False),        # no expert parallelism
    (4, 1, True, None, 4, 4, False),         # EP = TP
    (4, 1, True, 2, 2, 2, False),            # neuron_config.ep_degree wins inside a replica
    (4, 1, False, 2, 2, 2, False),           # ... also without --enable-expert-parallel
    (2, 2, True, None, 1, 4, True),          # experts across replicas: EP = TP × DP
    (2, 2, False, None, 1, 1, False),        # DP without EP: every replica holds all experts
])
def test_expert_layout_rule(tp, dp, ep, degree, inner, width, across):
    layout = ExpertLayout.of(tp, dp, ep, degree)
    assert (layout.inner, layout.width, layout.across) == (inner, width, across)


def test_resolution_reads_the_checkpoint_once_and_keeps_the_args(ckpt):
    args = EngineArgs(model=str(ckpt), served_model_name="mine", block_size=16)
    config = EngineConfig.from_args(args)
    assert config.model_dir == ckpt
    assert config.model.num_attention_heads == 8
    assert config.dtype == "float16"                     # --dtype auto: the checkpoint's
    assert config.max_model_len == 512                   # default: max_position_embeddings
    assert config.max_num_batched_tokens == 8192
    assert config.quantization == "auto"
    assert config.kv_transfer is None
    assert config.served_names == ("mine",)
    assert config.args.model == str(ckpt) and args.model == str(ckpt)
    assert config.blocks_per_sequence == 512 // 16 + 1


def test_served_name_is_the_model_as_given(ckpt, monkeypatch):
    """A Hugging Face repo id resolves to its snapshot directory, but is served by its id."""
    snapshot = ckpt / "hub" / "models--org--tiny" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(CONFIG))
    config = EngineConfig.from_args(EngineArgs(model="org/tiny", download_dir=str(ckpt / "hub")))
    assert config.model_dir == snapshot
    assert config.args.model == str(snapshot)            # processes handed args need no search
    assert config.served_names == ("org/tiny",)


def test_explicit_values_win(ckpt):
    config = resolve(ckpt, dtype="float32", max_model_len=100, max_num_batched_tokens=64,
                     hf_overrides={"num_local_experts": 8},
                     additional_config={"neuron_config": {"quantization": "mxfp4"}})
    assert config.dtype == "float32"
    assert (config.max_model_len, config.max_num_batched_tokens) == (100, 64)
    assert config.model.num_local_experts == 8           # --hf-overrides applied once, here
    assert config.quantization == "mxfp4"


def test_quantization_none_dequantises(ckpt):
    """`kvrelay generate --quantization none` reaches load_model as None (dequantise)."""
    assert resolve(ckpt, quantization="none").quantization is None
    assert resolve(ckpt, quantization="mxfp4").quantization == "mxfp4"
    with pytest.raises(ValueError, match="quantization must be mxfp4, auto or none, got 'fp8'"):
        resolve(ckpt, quantization="fp8")


@pytest.mark.parametrize("kwargs, message", [
    ({"tensor_parallel_size": 3}, "tensor_parallel_size 3 does not divide the 8 attention heads"),
    ({"tensor_parallel_size": 2, "additional_config": {"neuron_config": {"ep_degree": 4}}},
     "expert-parallel width 4 must divide tensor_parallel_size 2"),
    ({"tensor_parallel_size": 4, "data_parallel_size": 2, "enable_expert_parallel": True},
     "expert-parallel width 8 (TP 4 × DP 2) does not divide the 4 experts"),
    ({"max_num_seqs": 8, "additional_config": {"neuron_config": {"num_seqs_buckets": [1, 4]}}},
     "the last bucket (4) must equal --max-num-seqs (8)"),
    ({"kv_transfer_config": {"kv_role": "kv_sender"}}, "kv_role must be one of"),
    ({"kv_transfer_config": {"kv_rol": "kv_producer"}}, "unknown key 'kv_rol'"),
    ({"additional_config": {"neuron_config": {"ep_degreee": 2}}}, "unknown neuron_config key"),
])
def test_bad_values_are_one_line_errors(ckpt, kwargs, message):
    with pytest.raises(ValueError) as e:
        resolve(ckpt, **kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_missing_checkpoint_names_the_path(tmp_path):
    with pytest.raises(ValueError, match="not a local directory"):
        EngineConfig.from_args(EngineArgs(model=str(tmp_path / "nope"), download_dir=str(tmp_path)))
    with pytest.raises(ValueError, match=r"needs config.json"):
        EngineConfig.from_args(EngineArgs(model=str(tmp_path)))


def test_kv_budget(ckpt):
    per_block = 1000
    assert resolve(ckpt, num_gpu_blocks_override=40).num_blocks(per_block) == 40
    assert resolve(ckpt, kv_cache_memory_bytes=50_000).num_blocks(per_block) == 50
    # the default budget is capped at every sequence at full length: 2 × 32 + the null block
    assert resolve(ckpt, max_num_seqs=2, block_size=16).num_blocks(per_block) == 65
    with pytest.raises(ValueError, match="one sequence of max_model_len 512 needs 33"):
        resolve(ckpt, num_gpu_blocks_override=10).num_blocks(per_block)


def test_ignored_kv_transfer_keys_are_named(ckpt):
    tutorial = {"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                "kv_buffer_device": "cuda"}
    notes = resolve(ckpt, kv_transfer_config=tutorial).ignored_inputs("cpu")
    assert len(notes) == 1 and "kv_buffer_device 'cuda' ignored" in notes[0]
    assert resolve(ckpt, kv_transfer_config=tutorial).ignored_inputs("cuda") == []
    p2p = dict(tutorial, kv_ip="10.0.0.1", kv_port=14579, kv_rank=0, kv_parallel_size=2)
    notes = resolve(ckpt, kv_transfer_config=p2p).ignored_inputs("cuda")
    assert notes == [("--kv-transfer-config: kv_ip, kv_port, kv_rank, kv_parallel_size ignored "
                      "(vLLM P2P keys; NIXL peers exchange addresses over the side channel)")]
    assert resolve(ckpt).ignored_inputs("cpu") == []


def test_serve_reports_a_bad_layout_in_one_line(ckpt, capsys):
    from kvrelay.cli import main
    rc = main(["serve", str(ckpt), "--port", "0", "-tp", "3"])
    err = capsys.readouterr().err.strip()
    assert rc == 1
    assert err == ("kvrelay serve: error: tensor_parallel_size 3 does not divide the 8 "
                   "attention heads")
