"""The deploy planner: ports, side channels and device slices; the tutorial's full-size
topologies pass the dry-run with the tutorial's exact commands; invalid layouts are refused
naming the numbers."""
from __future__ import annotations

import json
import re
import shlex

import pytest

from kvrelay.deploy.layout import format_ids, make_plan, shell_command
from kvrelay.deploy.main import main
from kvrelay.deploy.shapes import model_config
from kvrelay.deploy.topology import TopologyError, topology_from_settings

TUTORIAL_120B = ["--model", "openai/gpt-oss-120b", "--prefill", "16", "--prefill-tp", "4",
                 "--decode", "1",
                 "--decode-tp", "8", "--decode-dp", "8", "--enable-expert-parallel", "--devices",
                 "0-63", "--hosts", "prefill=PREFILL_HOST", "decode=DECODE_HOST", "--dry-run"]
TUTORIAL_KV = '{"kv_connector": "NixlConnector", "kv_role": "%s", "kv_buffer_device": "cuda", ' \
              '"kv_connector_extra_config": {"backends": ["LIBFABRIC"]}}'


def dry_run(capsys, argv: list[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def commands(text: str) -> list[tuple[dict[str, str], list[str]]]:
    """The printed commands, parsed back: (env assignments, argv after the program)."""
    joined = text.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        command = "kvrelay " in line and not line.startswith("#")
        words = shlex.split(line.rstrip(" &")) if command else []
        if not words:
            continue
        env = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
        argv = [w for w in words if not re.match(r"^[A-Z_]+=", w)]
        assert argv[0] == "kvrelay", line
        out.append((env, argv[1:]))
    return out


def flag(argv: list[str], name: str) -> list[str]:
    """The values after `name` up to the next flag."""
    i = argv.index(name)
    values = []
    for a in argv[i + 1:]:
        if a.startswith("--"):
            break
        values.append(a)
    return values


def plan_of(settings: dict, devices: tuple[int, ...] = (0, 1)):
    topo = topology_from_settings(settings, "none", this_machine=devices)
    return make_plan(topo, model_config(topo.model))


# ---------------------------------------------------------------------------- the tutorial

def test_tutorial_120b_16p1d_dry_run(capsys):
    rc, out, err = dry_run(capsys, TUTORIAL_120B)
    assert rc == 0, err
    cmds = commands(out)
    serve = [c for c in cmds if c[1][0] == "serve"]
    assert len(serve) == 17
    assert [c[1][0] for c in cmds].count("proxy") == 1 and cmds[-1][1][0] == "validate"
    assert "layout OK: 17 server(s), 128 ranks, 1 proxy" in out
    assert ("decode × 1: TP8 DP8 EP64: 64 devices per server; per rank 8 heads, 1 KV head, "
            "2 experts per rank") in out
    for i, (env, argv) in enumerate(serve[:16]):
        assert env == {"NEURON_VISIBLE_DEVICES": f"{4 * i}-{4 * i + 3}",
                       "VLLM_NIXL_SIDE_CHANNEL_PORT": str(5559 + i)}
        assert argv[:2] == ["serve", "openai/gpt-oss-120b"]
        assert flag(argv, "--port") == [str(8100 + i)] and flag(argv, "--host") == ["0.0.0.0"]
        assert flag(argv, "--tensor-parallel-size") == ["4"]
        assert flag(argv, "--data-parallel-size") == ["1"]
        assert "--enable-expert-parallel" in argv and flag(argv, "--max-num-seqs") == ["1"]
        assert flag(argv, "--kv-transfer-config") == [TUTORIAL_KV % "kv_producer"]
        assert json.loads(flag(argv, "--additional-config")[0]) == {"neuron_config": {
            "quantization": "mxfp4", "ep_degree": 2, "kv_segment_size_buckets": [8192],
            "num_batched_tokens_buckets": [8192], "num_seqs_buckets": [1]}}
    env, decode = serve[16]
    assert env == {"NEURON_VISIBLE_DEVICES": "0-63", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5659"}
    assert flag(decode, "--port") == ["8200"] and flag(decode, "--optimization-level") == ["2"]
    assert flag(decode, "--tensor-parallel-size") == ["8"]
    assert flag(decode, "--data-parallel-size") == ["8"]
    assert flag(decode, "--max-logprobs") == ["0"] and flag(decode, "--max-num-seqs") == ["4"]
    assert flag(decode, "--kv-transfer-config") == [TUTORIAL_KV % "kv_consumer"]
    assert json.loads(flag(decode, "--additional-config")[0])["neuron_config"] == {
        "quantization": "mxfp4", "embedding_dp_size": 8, "lm_head_dp_size": 8,
        "kv_segment_size_buckets": [8192],
        "num_batched_tokens_buckets": [8192], "num_seqs_buckets": [4]}
    for argv in (serve[0][1], decode):
        assert flag(argv, "--max-model-len") == ["16384"]
        assert flag(argv, "--max-num-batched-tokens") == ["8192"]
        assert flag(argv, "--hf-overrides") == ['{"quantization_config": {}}']
        assert flag(argv, "--dtype") == ["bfloat16"]
        assert "--no-disable-hybrid-kv-cache-manager" in argv
    proxy = next(argv for _, argv in cmds if argv[0] == "proxy")
    assert proxy == ["proxy", "--port", "8000", "--host", "0.0.0.0", "--prefiller-host",
                     "PREFILL_HOST",
                     "--prefiller-port", *map(str, range(8100, 8116)), "--decoder-host",
                     "DECODE_HOST", "--decoder-port", "8200"]
    assert cmds[-1][1] == ["validate", "--base-url", "http://PREFILL_HOST:8000", "--model",
                           "openai/gpt-oss-120b", "--expect-di"]
    # per host: the tutorial's exports, the prefill servers and the proxy on PREFILL_HOST
    assert "# ---- host PREFILL_HOST: prefill-0 … prefill-15, proxy" in out
    assert "# ---- host DECODE_HOST: decode-0" in out
    for line in ("export VLLM_NEURON_COMPILATION_TIMEOUT=2400",
                 "export VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=1200",
                 "export VLLM_ENGINE_READY_TIMEOUT_S=5400",
                 "export VLLM_NIXL_SIDE_CHANNEL_HOST=0.0.0.0"):
        assert out.count(line) == 2
    assert "# decode-0: TP8 DP8 EP64, devices 0-63, HTTP 8200, side channel 5659-5666" in out


def test_tutorial_20b_variant(capsys):
    argv = [a if a != "openai/gpt-oss-120b" else "openai/gpt-oss-20b" for a in TUTORIAL_120B]
    argv[argv.index("--decode-dp") + 1] = "4"
    rc, out, err = dry_run(capsys, argv)
    assert rc == 0, err
    serve = [argv for _, argv in commands(out) if argv[0] == "serve"]
    assert len(serve) == 17
    decode = serve[16]
    assert "--optimization-level" not in decode and flag(decode, "--data-parallel-size") == ["4"]
    neuron = json.loads(flag(decode, "--additional-config")[0])["neuron_config"]
    assert neuron["lm_head_dp_size"] == 4
    assert ("decode × 1: TP8 DP4 EP32: 32 devices per server; per rank 8 heads, 1 KV head, "
            "1 expert per rank") in out
    assert "warning" not in out


def test_20b_with_the_120b_decode_layout_is_refused(capsys):
    argv = [a if a != "openai/gpt-oss-120b" else "openai/gpt-oss-20b" for a in TUTORIAL_120B]
    rc, out, err = dry_run(capsys, argv)
    assert rc == 1 and out == ""
    assert err == ("kvrelay deploy: error: invalid topology:\n  decode: expert-parallel width 64 "
                   "(TP 8 × DP 8) does not divide the 32 experts\n")


def test_yaml_config_gives_the_same_commands(capsys, tmp_path):
    (tmp_path / "topo.yaml").write_text("""
model: openai/gpt-oss-120b
devices: 0-63
hosts: {prefill: PREFILL_HOST, decode: DECODE_HOST}
prefill: {count: 16, tp: 4, enable_expert_parallel: true}
decode: {count: 1, tp: 8, dp: 8, enable_expert_parallel: true}
""")
    _, from_flags, _ = dry_run(capsys, TUTORIAL_120B)
    rc, from_yaml, err = dry_run(capsys, ["--config", str(tmp_path / "topo.yaml"), "--dry-run"])
    assert rc == 0, err
    assert from_yaml == from_flags
    # flags override the file
    rc, out, _ = dry_run(capsys,
                         ["--config", str(tmp_path / "topo.yaml"), "--prefill", "2", "--dry-run"])
    assert rc == 0 and len([c for c in commands(out) if c[1][0] == "serve"]) == 3


def test_single_instance_is_the_tutorials_first_command(capsys):
    rc, out, err = dry_run(capsys, ["--model", "openai/gpt-oss-120b", "-tp", "8", "--devices",
                                    "0-63", "--dry-run"])
    assert rc == 0, err
    cmds = commands(out)
    assert [c[1][0] for c in cmds] == ["serve", "validate"]
    env, argv = cmds[0]
    assert env == {"NEURON_VISIBLE_DEVICES": "0-7"}
    assert argv == ["serve", "openai/gpt-oss-120b", "--host", "127.0.0.1", "--port", "8000",
                    "--tensor-parallel-size", "8", "--data-parallel-size", "1",
                    "--enable-prefix-caching",
                    "--max-model-len", "16384", "--max-num-batched-tokens", "8192",
                    "--max-num-seqs", "4", "--no-disable-hybrid-kv-cache-manager", "--hf-overrides",
                    '{"quantization_config": {}}', "--additional-config",
                    '{"neuron_config": {"num_batched_tokens_buckets": [8192], '
                    '"num_seqs_buckets": [4]}}']
    assert cmds[1][1] == ["validate", "--base-url", "http://127.0.0.1:8000", "--model",
                          "openai/gpt-oss-120b"]
    assert "export VLLM_NEURON_COMPILATION_TIMEOUT=1200" in out and "SIDE_CHANNEL" not in out


# ---------------------------------------------------------------------------- assignment rules

def test_local_2p1d_ports_side_channels_and_shared_cores(tiny_config_dir, monkeypatch):
    monkeypatch.setattr("kvrelay.deploy.layout.local_device", lambda: "cpu")
    plan = plan_of({"model": str(tiny_config_dir), "prefill": {"count": 2}, "decode": {"count": 1},
                    "ports": {"proxy": 9000, "prefill": 9100, "decode": 9200,
                              "prefill_side_channel": 9300, "decode_side_channel": 9400}})
    got = [(s.name, s.host, s.port, s.side_channel_ports, s.devices, dict(s.env))
           for s in plan.servers]
    assert got == [
        ("prefill-0", "127.0.0.1", 9100, (9300,), (0,),
         {"NEURON_VISIBLE_DEVICES": "0", "VLLM_NIXL_SIDE_CHANNEL_PORT": "9300"}),
        ("prefill-1", "127.0.0.1", 9101, (9301,), (1,),
         {"NEURON_VISIBLE_DEVICES": "1", "VLLM_NIXL_SIDE_CHANNEL_PORT": "9301"}),
        ("decode-0", "127.0.0.1", 9200, (9400,), (0,),
         {"NEURON_VISIBLE_DEVICES": "0", "VLLM_NIXL_SIDE_CHANNEL_PORT": "9400"}),
    ]
    assert plan.warnings == (("host 127.0.0.1: 3 ranks on 2 devices (0-1): device slices overlap, "
                              "so CPU cores are shared (one thread per rank); on Neuron or GPUs "
                              "this layout needs 3 devices per host"),)
    assert dict(plan.exports) == {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
    assert plan.proxy.args == ("proxy", "--port", "9000", "--host", "127.0.0.1", "--prefiller-host",
                               "127.0.0.1",
                               "--prefiller-port", "9100", "9101", "--decoder-host", "127.0.0.1",
                               "--decoder-port", "9200")
    prefill = plan.servers[0].args
    assert prefill[:12] == ("serve", str(tiny_config_dir), "--host", "127.0.0.1", "--port", "9100",
                            "--tensor-parallel-size", "1", "--data-parallel-size", "1",
                            "--kv-transfer-config",
                            ('{"kv_connector": "NixlConnector", "kv_role": "kv_producer", '
                             '"kv_buffer_device": "cpu", "kv_connector_extra_config": '
                             '{"backends": ["UCX"]}}'))


def test_port_moves_the_proxy_and_base_port_the_servers(capsys, tiny_config_dir):
    di = ["--model", str(tiny_config_dir), "--prefill", "2", "--decode", "1", "--dry-run"]
    for flags, proxy, prefill, decode in [
            ([], 8000, [8100, 8101], 8200),
            (["--port", "9000"], 9000, [8100, 8101], 8200),
            (["--base-port", "7000"], 8000, [7100, 7101], 7200),      # the proxy stays on 8000
            (["--port", "9000", "--base-port", "7000"], 9000, [7100, 7101], 7200)]:
        rc, out, err = dry_run(capsys, di + flags)
        assert rc == 0, err
        cmds = [argv for _, argv in commands(out)]
        assert [flag(a, "--port") for a in cmds if a[0] == "serve"] == [
            [str(p)] for p in [*prefill, decode]]
        proxy_cmd = next(a for a in cmds if a[0] == "proxy")
        assert flag(proxy_cmd, "--port") == [str(proxy)]
        assert flag(proxy_cmd, "--prefiller-port") == [str(p) for p in prefill]
        assert flag(proxy_cmd, "--decoder-port") == [str(decode)]
        assert flag(cmds[-1], "--base-url") == [f"http://127.0.0.1:{proxy}"]
    # a single instance has no proxy: clients reach the server on --port
    for flags, port in [([], 8000), (["--port", "9000"], 9000), (["--base-port", "7000"], 8000)]:
        rc, out, _ = dry_run(capsys, ["--model", str(tiny_config_dir), "--dry-run", *flags])
        serve = next(argv for _, argv in commands(out) if argv[0] == "serve")
        assert rc == 0 and flag(serve, "--port") == [str(port)]


def test_port_flags_override_the_yaml_ports(capsys, tiny_config_dir, tmp_path):
    (tmp_path / "topo.yaml").write_text(f"model: {tiny_config_dir}\nprefill: {{count: 1}}\n"
                                        "decode: {count: 1}\nports: {proxy: 9500, prefill: 9600}\n")
    rc, out, _ = dry_run(capsys, ["--config", str(tmp_path / "topo.yaml"), "--dry-run"])
    proxy = next(argv for _, argv in commands(out) if argv[0] == "proxy")
    assert rc == 0 and flag(proxy, "--port") == ["9500"]
    assert flag(proxy, "--prefiller-port") == ["9600"] and flag(proxy, "--decoder-port") == ["8200"]
    rc, out, _ = dry_run(capsys, ["--config", str(tmp_path / "topo.yaml"), "--port", "9001",
                                  "--dry-run"])
    proxy = next(argv for _, argv in commands(out) if argv[0] == "proxy")
    assert rc == 0 and flag(proxy, "--port") == ["9001"]
    assert flag(proxy, "--prefiller-port") == ["9600"]


def _kv_devices(settings: dict) -> list[str | None]:
    plan = plan_of(settings)
    return [json.loads(s.args[s.args.index("--kv-transfer-config") + 1]).get("kv_buffer_device")
            for s in plan.servers]


def test_kv_buffer_device_is_the_servers_device(tiny_config_dir, monkeypatch):
    di = {"model": str(tiny_config_dir), "prefill": {"count": 1}, "decode": {"count": 1}}
    monkeypatch.setattr("kvrelay.deploy.layout.local_device", lambda: "cpu")
    assert _kv_devices(di) == ["cpu", "cpu"]            # no "cuda" warning from every server
    assert _kv_devices(di | {"serve_args": ["--device", "cuda"]}) == ["cuda", "cuda"]
    assert _kv_devices(di | {"decode": {"count": 1, "args": ["--device=cuda"]}}) == ["cpu", "cuda"]
    assert _kv_devices(di | {"serve_args": ["--device", "cuda", "--device", "auto"]}) == [
        "cpu", "cpu"]                                    # the last one wins, as in argparse
    assert _kv_devices(di | {"connector": "tcp"}) == [None, None]
    monkeypatch.setattr("kvrelay.deploy.layout.local_device", lambda: "cuda")
    assert _kv_devices(di) == ["cuda", "cuda"]
    # other hosts: their device is not known here; the tutorial's value unless --device says
    remote = di | {"hosts": {"prefill": "A", "decode": "B"}}
    monkeypatch.setattr("kvrelay.deploy.layout.local_device", lambda: "cpu")
    assert _kv_devices(remote) == ["cuda", "cuda"]
    assert _kv_devices(remote | {"serve_args": ["--device", "cpu"]}) == ["cpu", "cpu"]


def test_local_device_needs_a_gpu_and_a_cuda_build_of_torch(tmp_path):
    from kvrelay.deploy.layout import local_device
    gpus, cpu_torch, cuda_torch = tmp_path / "gpus", tmp_path / "cpu", tmp_path / "cuda"
    for d in (gpus, cpu_torch / "lib", cuda_torch / "lib"):
        d.mkdir(parents=True)
    (cpu_torch / "lib" / "libtorch_cpu.so").touch()
    (cuda_torch / "lib" / "libtorch_cuda.so").touch()
    assert local_device(tmp_path / "absent", [cuda_torch]) == "cpu"     # no NVIDIA driver
    assert local_device(gpus, [cuda_torch]) == "cpu"                    # the driver sees no GPU
    (gpus / "0000:00:1e.0").mkdir()
    assert local_device(gpus, [cpu_torch]) == "cpu"                     # a CPU-only torch
    assert local_device(gpus, [cuda_torch]) == "cuda"
    assert local_device(gpus, []) == "cpu"                              # no torch


def test_servers_spread_over_their_hosts_and_fill_devices_in_order(tiny_config_dir):
    plan = plan_of({"model": str(tiny_config_dir), "devices": "0-7",
                    "hosts": {"prefill": ["A", "B"], "decode": "C"},
                    "prefill": {"count": 4, "tp": 2}, "decode": {"count": 2, "tp": 2, "dp": 2}})
    got = [(s.name, s.host, format_ids(s.devices), s.side_channel_ports) for s in plan.servers]
    assert got == [("prefill-0", "A", "0-1", (5559,)), ("prefill-1", "A", "2-3", (5560,)),
                   ("prefill-2", "B", "0-1", (5561,)), ("prefill-3", "B", "2-3", (5562,)),
                   ("decode-0", "C", "0-3", (5659, 5660)), ("decode-1", "C", "4-7", (5661, 5662))]
    assert plan.warnings == ()
    assert plan.proxy.host == "A" and dict(plan.exports)["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "0.0.0.0"
    assert plan.proxy.args[5:] == ("--prefiller-host", "A", "A", "B", "B", "--prefiller-port",
                                   "8100", "8101",
                                   "8102", "8103", "--decoder-host", "C", "--decoder-port", "8200",
                                   "8201")


def test_tcp_connector_and_passthrough_args(tiny_config_dir):
    plan = plan_of({"model": str(tiny_config_dir), "connector": "tcp",
                    "prefill": {"count": 1, "args": ["--seed", "3"]},
                    "decode": {"count": 1},
                    "serve_args": ["--dtype", "float32", "--additional-config",
                                   '{"neuron_config": {"num_seqs_buckets": [8]}}']})
    prefill, decode = (s.args for s in plan.servers)
    assert json.loads(prefill[prefill.index("--kv-transfer-config") + 1]) == {
        "kv_connector": "TcpConnector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"backends": ["TCP"]}}
    assert prefill[-6:] == ("--additional-config", '{"neuron_config": {"num_seqs_buckets": [8]}}',
                            "--dtype", "float32", "--seed", "3")
    assert decode[-4:] == ("--additional-config", '{"neuron_config": {"num_seqs_buckets": [8]}}',
                           "--dtype", "float32")


def test_printed_commands_parse_back_to_the_plan(tiny_config_dir):
    plan = plan_of({"model": str(tiny_config_dir), "prefill": {"count": 1}, "decode": {"count": 1},
                    "serve_args": ["--served-name-with space", "it's", '{"a": [1, 2]}']})
    for s in plan.servers:
        text = shell_command(s.args, s.env).replace("\\\n", " ")
        words = shlex.split(text)
        assert words[:2] == [f"{k}={v}" for k, v in s.env] and tuple(words[3:]) == s.args


def test_format_ids():
    assert format_ids((0, 1, 2, 3, 6, 8, 9)) == "0-3,6,8-9"
    assert format_ids((5,)) == "5" and format_ids(()) == ""


# ---------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("argv, problems", [
    (["--prefill-tp", "3"],
     ["prefill: tensor_parallel_size 3 does not divide the 64 attention heads",
      "tensor_parallel_size: prefill 3, decode 8: the decode TP size must be a multiple of the "
      "prefill TP size (each decode rank reads its KV heads from one prefill rank)"]),
    (["--decode-tp", "2", "--decode-dp", "32"],
     ["tensor_parallel_size: prefill 4, decode 2: the decode TP size must be a multiple of the "
      "prefill TP size (each decode rank reads its KV heads from one prefill rank)"]),
    (["--decode-dp", "3"],
     ["decode: expert-parallel width 24 (TP 8 × DP 3) does not divide the 128 experts"]),
    (["--decode-tp", "16", "--decode-dp", "16"],
     ["decode: expert-parallel width 256 (TP 16 × DP 16) does not divide the 128 experts"]),
    (["--prefill-ep-degree", "8"],
     ["prefill: expert-parallel width 8 must divide tensor_parallel_size 4"]),
])
def test_invalid_tutorial_variants_are_refused_naming_the_numbers(capsys, argv, problems):
    rc, out, err = dry_run(capsys, _override(TUTORIAL_120B, argv))
    assert rc == 1 and out == ""
    assert err.splitlines()[1:] == [f"  {p}" for p in problems]


def test_neuron_config_is_checked_as_serve_checks_it(capsys):
    extra = '{"neuron_config": {"lm_head_dp_size": 4, "ep_degree": 4}}'
    rc, _, err = dry_run(capsys, TUTORIAL_120B + ["--", "--additional-config", extra])
    assert rc == 1
    assert err.splitlines()[1:] == [
        ("  prefill: neuron_config.lm_head_dp_size 4 must equal --data-parallel-size 1 (the layer "
         "is replicated in every data-parallel replica and vocab-sharded over its 4 TP ranks)"),
        ("  decode: neuron_config.lm_head_dp_size 4 must equal --data-parallel-size 8 (the layer "
         "is replicated in every data-parallel replica and vocab-sharded over its 8 TP ranks)")]
    rc, _, err = dry_run(capsys, TUTORIAL_120B + ["--", "--additional-config",
                                                  '{"neuron_config": {"colour": 1}}'])
    assert rc == 1
    assert "  prefill: --additional-config: unknown neuron_config key 'colour'" in err.splitlines()


def test_port_collisions_on_one_host(capsys):
    argv = _override(TUTORIAL_120B, ["--hosts", "all=HOST"])
    rc, _, err = dry_run(capsys, _override(argv, ["--prefill", "101"]))
    assert rc == 1
    assert ("  port collision on HOST: decode-0 HTTP and prefill-100 HTTP both use 8200"
            in err.splitlines())
    assert ("  port collision on HOST: decode-0 side channel and prefill-100 side channel "
            "both use 5659" in err.splitlines())


@pytest.mark.parametrize("settings, problem", [
    ({"prefill": {"count": 2}}, ("disaggregated serving needs at least one decode server (--decode "
                                 "N); for a single instance leave out --prefill and --decode")),
    ({"single": {"tp": 2}, "decode": {"count": 1}},
     "single together with prefill/decode: a topology is either one server or prefill + decode"),
    ({"prefill": {"count": 1, "tp": 0}, "decode": {}},
     "prefill.tp: expected a positive integer, got 0"),
    ({"prefill": {"count": 1, "pt": 2}, "decode": {}},
     ("prefill: unknown setting 'pt' (known: args, count, dp, enable_expert_parallel, "
      "ep_degree, max_num_seqs, tp)")),
    ({"ports": {"proxy": 70000}}, "ports.proxy: 70000 is not a TCP port"),
    ({"devices": "3-1"}, "devices: bad device list '3-1': range 3-1 is descending"),
    ({"flavour": 1}, ("unknown setting 'flavour' (known: connector, decode, devices, env, hosts, "
                      "kv_backend, model, ports, prefill, preset, proxy_args, serve_args, "
                      "served_model_name, single)")),
])
def test_bad_settings_are_refused(tiny_config_dir, settings, problem):
    with pytest.raises(TopologyError) as e:
        plan_of({"model": str(tiny_config_dir)} | settings)
    assert e.value.problems == [problem]


def test_flags_deploy_sets_itself_cannot_be_passed_through(capsys, tiny_config_dir):
    rc, _, err = dry_run(capsys, ["--model", str(tiny_config_dir), "--prefill", "1", "--decode",
                                  "1", "--dry-run", "--", "--port", "9000", "--dtype", "float32"])
    assert rc == 1
    assert err.splitlines()[1].startswith("  serve args: --port is set by deploy from the topology")


def test_proxy_args_reach_the_proxy_command_and_are_checked(capsys, tiny_config_dir):
    base = ["--model", str(tiny_config_dir), "--prefill", "2", "--decode", "1", "--dry-run"]
    rc, out, _ = dry_run(capsys,
                         base + ["--proxy-args", "--routing round_robin --disagg-policy auto"])
    assert rc == 0
    proxy = next(argv for _, argv in commands(out) if argv[0] == "proxy")
    assert flag(proxy, "--routing") == ["round_robin"]
    assert flag(proxy, "--disagg-policy") == ["auto"]
    from kvrelay.proxy.main import build_parser
    parsed = build_parser().parse_args(proxy[1:])         # the printed command is the proxy's
    assert parsed.prefiller_port == [8100, 8101] and parsed.routing == "round_robin"
    for bad, problem in [("--routing nope",
                          "proxy_args: argument --routing: invalid choice: 'nope'"),
                         ("--port 9", "proxy_args: --port is set by deploy from the topology"),
                         ("--frobnicate", "proxy_args: unknown flag --frobnicate")]:
        rc, _, err = dry_run(capsys, base + [f"--proxy-args={bad}"])
        assert rc == 1 and err.splitlines()[1].strip().startswith(problem), err
    rc, _, err = dry_run(capsys, ["--model", str(tiny_config_dir), "--dry-run", "--proxy-args",
                                  "--routing x"])
    assert rc == 1 and "a single instance has no proxy" in err


def test_unknown_model_and_bad_flags(capsys, tmp_path):
    rc, _, err = dry_run(capsys, ["--model", str(tmp_path / "nothing"), "--dry-run"])
    assert rc == 1
    assert ("no config.json there and not a built-in id (openai/gpt-oss-120b, "
            "openai/gpt-oss-20b)") in err
    rc, _, err = dry_run(capsys, ["--model", "x", "--prefill", "two"])
    assert rc == 2 and "--prefill: invalid int value: 'two'" in err


def test_without_a_model_the_servers_serve_the_embedded_one(tiny_config_dir):
    topo = topology_from_settings({"prefill": {}, "decode": {}}, "none", this_machine=(0, 1))
    # the embedded model's config is not needed here
    plan = make_plan(topo, model_config(str(tiny_config_dir)))
    assert topo.model is None and plan.served_name == "kvrelay/smollm2-135m-gpt-oss"
    assert [s.args[:3] for s in plan.servers] == [("serve", "--host", "127.0.0.1")] * 2


def _override(argv: list[str], changes: list[str]) -> list[str]:
    """argv with the value after each flag in `changes` replaced, or the flag added."""
    out = list(argv)
    for name, value in zip(changes[::2], changes[1::2]):
        if name not in out:
            out += [name, value]
        elif name == "--hosts":
            i = out.index("--hosts")
            out[i + 1:i + 3] = [value]
        else:
            out[out.index(name) + 1] = value
    return out


@pytest.fixture()
def tiny_config_dir(tmp_path):
    """A checkpoint directory with just the config (the planner reads nothing else)."""
    from tests.factories import TINY
    cfg = {"model_type": "gpt_oss"} | TINY | {"rope_theta": 150000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path
