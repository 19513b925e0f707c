"""`kvrelay serve`'s checks before its heavy imports (issue 30): a bad path, a bad
--kv-transfer-config / --additional-config or a bad tool flag is one `ValueError` naming it,
raised while the flags become one `cli.ServeConfig`, which needs neither torch nor the server
(that the command exits within a second without importing torch:
tests/e2e/test_cli_fast_errors.py). A model id
that is not a local directory is looked up in the HF cache, as the loader does. And
`--quantization none` is accepted, meaning what it means for `kvrelay generate`: MXFP4
experts dequantised at load."""
from __future__ import annotations

import json
import socket
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


def test_a_good_command_passes_and_gives_the_engine_args(ckpt, serve_config):
    config = serve_config(str(ckpt), "--max-num-seqs", "8", "--kv-transfer-config",
                          '{"kv_role": "kv_consumer"}', "--tool-call-parser", "openai",
                          "--port", "8123", "--api-key", "k")
    assert config.engine.model == str(ckpt) and config.engine.max_num_seqs == 8
    assert config.engine.kv_transfer_config == {"kv_role": "kv_consumer"}
    assert config.agent.tool_call_parser == "openai"
    assert (config.http.host, config.http.port, config.http.api_key) == ("127.0.0.1", 8123, "k")
    assert serve_config().engine.model is None     # the embedded model: built later, not here


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
def test_bad_flags_are_one_line_errors(argv, message, serve_config):
    with pytest.raises(ValueError) as e:
        serve_config(*argv)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_model_paths_are_checked_with_their_config(ckpt, tmp_path, serve_config):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"config\.json: not found"):
        serve_config(str(tmp_path / "empty"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="invalid JSON"):
        serve_config(str(tmp_path / "bad"))
    with pytest.raises(CheckpointError, match="is a file; expected a checkpoint directory"):
        serve_config(str(ckpt / "config.json"))
    with pytest.raises(ValueError, match="model_type"):
        serve_config(str(ckpt), "--hf-overrides", '{"model_type": "llama"}')


def test_a_repo_id_is_found_in_the_hf_cache(ckpt, tmp_path, serve_config):
    cache = tmp_path / "hub"
    snapshot = cache / "models--org--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(CONFIG))
    engine_args = serve_config("org/tiny", "--download-dir", str(cache)).engine
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
                                                                loaded_as, serve_config):
    engine_args = serve_config(str(ckpt), *flag).engine
    assert engine_args.quantization == engine_value
    assert EngineConfig.from_args(engine_args).quantization == loaded_as
    # `kvrelay generate --quantization X` hands LLM the same value, hence the same config
    generate = cli.build_parser().parse_args(["generate", "--model", str(ckpt), *flag])
    assert (generate.quantization == (engine_value or "auto"))


def test_serve_refuses_an_unknown_quantization():
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--quantization", "fp8"])


def test_serve_claims_its_http_port_and_a_producers_side_channels(monkeypatch):
    """What `kvrelay serve` checks is free before anything slow: HTTP, and for a KV producer
    the side channel of each replica this node runs (from --data-parallel-start-rank)."""
    from kvrelay.config import EngineArgs
    from kvrelay.ports import serve_ports
    for name in ("VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_NIXL_SIDE_CHANNEL_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVRELAY_NIXL_SIDE_CHANNEL_PORT", "5600")
    monkeypatch.setenv("KVRELAY_NIXL_SIDE_CHANNEL_HOST", "10.0.0.2")
    side = "KV side channel (VLLM_NIXL_SIDE_CHANNEL_PORT (or KVRELAY_NIXL_SIDE_CHANNEL_PORT))"
    assert serve_ports("0.0.0.0", 8000, EngineArgs()) == [("HTTP", "0.0.0.0", 8000)]
    consumer = EngineArgs(kv_transfer_config={"kv_role": "kv_consumer"})
    assert serve_ports("127.0.0.1", 8001, consumer) == [("HTTP", "127.0.0.1", 8001)]
    node = EngineArgs(kv_transfer_config={"kv_role": "kv_producer"}, data_parallel_size=4,
                      data_parallel_size_local=2, data_parallel_start_rank=2, headless=True)
    assert serve_ports("127.0.0.1", 8002, node) == [
        ("HTTP", "127.0.0.1", 8002), (side, "10.0.0.2", 5602), (side, "10.0.0.2", 5603)]


def test_a_server_asks_for_its_ray_cluster_before_resolving_the_engine(ckpt, capsys):
    """No Ray cluster at --ray-address is one line, asked with the ports before the engine
    config is resolved: the layout below (TP 3 does not divide the 4 attention heads) would
    be refused by the resolution, but is not reached."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = s.getsockname()[1]              # closed again: nobody listens there
    argv = ["serve", str(ckpt), "--port", "0", "-tp", "3", "--distributed-executor-backend",
            "ray", "--ray-address", f"127.0.0.1:{nobody}"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("kvrelay serve: error: cannot join a Ray cluster at "
                          f"'127.0.0.1:{nobody}'")
