"""`kvrelay serve`'s checks before its heavy imports (issue 30): a bad path, a bad
--kv-transfer-config / --additional-config or a bad tool flag is one `ValueError` naming it,
from `cli.preflight`, which needs neither torch nor the server (that the command exits
within a second without importing torch: tests/e2e/test_cli_fast_errors.py). A model id
that is not a local directory is looked up in the HF cache, as the loader does. And
`--quantization none` is accepted, meaning what it means for `kvrelay generate`: MXFP4
experts dequantised at load."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrelay import cli
from kvrelay.config import EngineConfig
from kvrelay.model.config import CheckpointError
from kvrelay.model.locate import locate_checkpoint
from tests.factories import TINY

CONFIG = {"model_type": "gpt_oss"} | TINY


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(CONFIG))
    return tmp_path / "ckpt"


def preflight(*argv: str):
    return cli.preflight(cli.build_parser().parse_args(["serve", *argv]))


def test_a_good_command_passes_and_gives_the_engine_args(ckpt):
    engine_args, agent = preflight(str(ckpt), "--max-num-seqs", "8", "--kv-transfer-config",
                                   '{"kv_role": "kv_consumer"}', "--tool-call-parser", "openai")
    assert engine_args.model == str(ckpt) and engine_args.max_num_seqs == 8
    assert engine_args.kv_transfer_config == {"kv_role": "kv_consumer"}
    assert agent.tool_call_parser == "openai"
    assert preflight()[0].model is None            # the embedded model: built later, not here


@pytest.mark.parametrize("argv, message", [
    (["/no/such/dir"], "model '/no/such/dir' is not a local directory and was not found in"),
    (["--kv-transfer-config", '{"kv_role": "bogus"}'],
     "--kv-transfer-config: kv_role must be one of kv_producer, kv_consumer, kv_both, got 'bogus'"),
    (["--kv-transfer-config", '{"kv_connector": "P2pNcclConnector"}'],
     "--kv-transfer-config: kv_connector 'P2pNcclConnector' is not supported"),
    (["--additional-config", '{"neuron_config": {"colour": 1}}'],
     "--additional-config: unknown neuron_config key 'colour'"),
    (["--tool-call-parser", "hermes"], "--tool-call-parser: only openai"),
    (["--quantization", "none", "--additional-config",
      '{"neuron_config": {"quantization": "mxfp4"}}'],
     "--quantization none contradicts --additional-config's neuron_config.quantization 'mxfp4'"),
    (["--max-queued-requests", "-1"], "--max-queued-requests"),
    (["--max-num-seqs", "0"], "max_num_seqs must be at least 1, got 0"),
    (["-dp", "2", "-dpl", "3"], "--data-parallel-size-local 3 must be between 1 and"),
])
def test_bad_flags_are_one_line_errors(argv, message):
    with pytest.raises(ValueError) as e:
        preflight(*argv)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_model_paths_are_checked_with_their_config(ckpt, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"config\.json: not found"):
        preflight(str(tmp_path / "empty"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="invalid JSON"):
        preflight(str(tmp_path / "bad"))
    with pytest.raises(CheckpointError, match="is a file; expected a checkpoint directory"):
        preflight(str(ckpt / "config.json"))
    with pytest.raises(ValueError, match="model_type"):
        preflight(str(ckpt), "--hf-overrides", '{"model_type": "llama"}')


def test_a_repo_id_is_found_in_the_hf_cache(ckpt, tmp_path):
    cache = tmp_path / "hub"
    snapshot = cache / "models--org--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(CONFIG))
    engine_args, _ = preflight("org/tiny", "--download-dir", str(cache))
    assert engine_args.model == "org/tiny"                 # served under the name given
    assert locate_checkpoint("org/tiny", str(cache)) == snapshot
    assert locate_checkpoint(str(ckpt), None) == ckpt == locate_checkpoint(f"{ckpt}/", str(cache))
    for model in ("org/other", str(tmp_path / "nothing")):
        with pytest.raises(CheckpointError, match="not found in"):
            locate_checkpoint(model, str(cache))


def test_serve_main_prints_one_line_and_exits_1(capsys):
    assert cli.main(["serve", "/no/such/dir"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvrelay serve: error: model '/no/such/dir'")


@pytest.mark.parametrize("flag, engine_value, loaded_as", [
    ([], None, "auto"),                       # MXFP4 checkpoints stay packed, dense stay dense
    (["--quantization", "auto"], "auto", "auto"),
    (["--quantization", "mxfp4"], "mxfp4", "mxfp4"),
    (["--quantization", "none"], "none", None),        # dequantise MXFP4 experts at load
])
def test_serve_quantization_none_dequantises_as_generate_does(ckpt, flag, engine_value,
                                                                loaded_as):
    engine_args, _ = preflight(str(ckpt), *flag)
    assert engine_args.quantization == engine_value
    assert EngineConfig.from_args(engine_args).quantization == loaded_as
    # `kvrelay generate --quantization X` hands LLM the same value, hence the same config
    generate = cli.build_parser().parse_args(["generate", "--model", str(ckpt), *flag])
    assert (generate.quantization == (engine_value or "auto"))


def test_serve_refuses_an_unknown_quantization():
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--quantization", "fp8"])
