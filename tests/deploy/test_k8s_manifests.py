"""`kvrelay deploy --emit k8s`: the tutorial's 1P1D and 2P1D and a server spanning several pods,
rendered and validated offline against Kubernetes' OpenAPI schema (kubernetes-validate,
strict: unknown fields fail). A LeaderWorkerSet is a CRD the package has no schema for: its
leader and worker pod templates are validated inside a Deployment, its own few fields here.

Beyond the schema: every command is one `kvrelay serve` / `kvrelay proxy` accepts, the KV
secret reaches the servers only as a mounted file, every backend the proxy is given is a pod
name a rendered headless Service publishes, probes hit /health on the server's port, and the
ports are the tutorial's."""
from __future__ import annotations

import base64
import re
import stat

import kubernetes_validate
import pytest
import yaml

from kvrelay.deploy.main import main

K8S_VERSION = "1.30"
NS = "llm"
IMAGE = "registry.example/kvrelay:test"
TUTORIAL = ["--model", "openai/gpt-oss-120b", "--prefill-tp", "4", "--decode", "1",
            "--decode-tp", "8", "--decode-dp", "8", "--enable-expert-parallel"]
EMIT = ["--emit", "k8s", "--k8s-image", IMAGE, "--k8s-model-pvc", "gpt-oss-120b",
        "--k8s-namespace", NS]
LWS_SPEC = {"replicas", "startupPolicy", "leaderWorkerTemplate", "rolloutStrategy",
            "networkConfig"}
LWS_TEMPLATE = {"size", "restartPolicy", "leaderTemplate", "workerTemplate"}


def emit(capsys, *argv: str) -> list[dict]:
    rc = main([*argv])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return [d for d in yaml.safe_load_all(out.out) if d is not None]


def one_p_one_d(capsys, *extra: str) -> list[dict]:
    return emit(capsys, *TUTORIAL, "--prefill", "1", "--devices", "0-63", *EMIT, *extra)


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[dict], kind: str, name: str) -> dict:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def pod_templates(doc: dict) -> list[tuple[str, dict]]:
    """(which, template) of a workload: its template, or an LWS's leader and worker ones."""
    if doc["kind"] == "LeaderWorkerSet":
        lwt = doc["spec"]["leaderWorkerTemplate"]
        return [("leader", lwt["leaderTemplate"]), ("worker", lwt["workerTemplate"])]
    if doc["kind"] in ("Deployment", "StatefulSet"):
        return [("pod", doc["spec"]["template"])]
    return []


def containers(docs: list[dict]) -> list[tuple[str, dict, dict]]:
    """(which, container, pod spec) of every pod template."""
    return [(which, c, t["spec"]) for d in docs for which, t in pod_templates(d)
            for c in t["spec"]["containers"]]


def validate(doc: dict) -> None:
    """The schema of the Kubernetes API (strict); an LWS: its pod templates as Deployments and
    its own fields against the LeaderWorkerSet v1 API's names and values."""
    if doc["kind"] != "LeaderWorkerSet":
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        return
    assert doc["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = doc["spec"]
    assert set(spec) <= LWS_SPEC and set(spec["leaderWorkerTemplate"]) <= LWS_TEMPLATE
    assert spec["startupPolicy"] in ("LeaderCreated", "LeaderReady")
    lwt = spec["leaderWorkerTemplate"]
    assert isinstance(lwt["size"], int) and lwt["size"] >= 2
    assert lwt["restartPolicy"] in ("RecreateGroupOnPodRestart", "None")
    for _, template in pod_templates(doc):
        kubernetes_validate.validate(
            {"apiVersion": "apps/v1", "kind": "Deployment",
             "metadata": {"name": doc["metadata"]["name"], "namespace": NS},
             "spec": {"selector": {"matchLabels": template["metadata"]["labels"]},
                      "template": template}}, K8S_VERSION, strict=True)


def kubelet(text: str, env: dict[str, str]) -> str:
    """What the kubelet makes of $(VAR) and $$ in a command or argument."""
    text = re.sub(r"(?<!\$)\$\((\w+)\)", lambda m: env.get(m[1], m[0]), text)
    return text.replace("$$", "$")


def flag(args: list[str], name: str) -> list[str]:
    i = args.index(name)
    values = []
    for a in args[i + 1:]:
        if a.startswith("--"):
            break
        values.append(a)
    return values


def port_named(container: dict, name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def serve_args(container: dict, worker_index: int = 0) -> list[str]:
    """The argv `kvrelay` gets in the pod: the kubelet's expansion, then a worker's shell."""
    env = {"POD_IP": "10.0.0.5", "LWS_LEADER_ADDRESS": "kvrelay-decode-0.kvrelay-decode.llm"}
    args = [kubelet(a, env) for a in container["args"]]
    if container["command"] == ["kvrelay"]:
        return args
    sh, dash_c, script, arg0 = container["command"]
    assert (sh, dash_c, arg0) == ("/bin/sh", "-c", "kvrelay")
    per_pod = re.fullmatch(r'exec kvrelay "\$@" --data-parallel-start-rank '
                           r'"\$\(\(LWS_WORKER_INDEX \* (\d+)\)\)"', kubelet(script, env))
    assert per_pod, script
    return args + ["--data-parallel-start-rank", str(worker_index * int(per_pod[1]))]


def engine_args(argv: list[str]):
    """argv parsed by `kvrelay serve`'s own parser into its engine arguments (their checks
    included: data-parallel ranks, headless)."""
    from kvrelay.cli import SERVE_ENGINE_FLAGS, build_parser
    from kvrelay.config import EngineArgs
    ns = build_parser().parse_args(argv)
    assert ns.command == "serve"
    return EngineArgs(**{name: getattr(ns, name) for name in SERVE_ENGINE_FLAGS})


# ---------------------------------------------------------------------------- the layouts

def test_tutorial_1p1d_is_valid_kubernetes_with_the_tutorials_commands(capsys):
    docs = one_p_one_d(capsys)
    assert [(d["kind"], d["metadata"]["name"]) for d in docs] == [
        ("Secret", "kvrelay-kv-secret"),
        ("Service", "kvrelay-prefill"), ("StatefulSet", "kvrelay-prefill"),
        ("Service", "kvrelay-decode"), ("StatefulSet", "kvrelay-decode"),
        ("Service", "kvrelay-proxy"), ("Deployment", "kvrelay-proxy")]
    for d in docs:
        validate(d)
        assert d["metadata"]["namespace"] == NS
    prefill = named(docs, "StatefulSet", "kvrelay-prefill")["spec"]
    decode = named(docs, "StatefulSet", "kvrelay-decode")["spec"]
    assert prefill["replicas"] == decode["replicas"] == 1
    p = engine_args(prefill["template"]["spec"]["containers"][0]["args"])
    d = engine_args(decode["template"]["spec"]["containers"][0]["args"])
    assert (p.tensor_parallel_size, p.data_parallel_size, p.max_num_seqs) == (4, 1, 1)
    assert (d.tensor_parallel_size, d.data_parallel_size, d.max_num_seqs) == (8, 8, 4)
    assert p.enable_expert_parallel and d.enable_expert_parallel
    assert d.optimization_level == 2 and d.max_logprobs == 0
    assert p.additional_config["neuron_config"]["ep_degree"] == 2
    assert d.additional_config["neuron_config"]["embedding_dp_size"] == 8
    assert (p.model, p.served_model_name) == ("/model", ["openai/gpt-oss-120b"])


def test_ports_are_the_tutorials(capsys):
    docs = emit(capsys, *TUTORIAL, "--prefill", "2", "--devices", "0-63", *EMIT)
    for _, c, _ in containers(docs):                         # each listens where it says
        assert flag(c["args"], "--port") == [str(port_named(c, "http"))]
    prefill, decode = (named(docs, "StatefulSet", f"kvrelay-{r}")["spec"]["template"]["spec"]
                       ["containers"][0] for r in ("prefill", "decode"))
    assert port_named(prefill, "http") == 8100 and port_named(decode, "http") == 8200
    proxy = named(docs, "Deployment", "kvrelay-proxy")["spec"]["template"]["spec"]
    assert port_named(proxy["containers"][0], "http") == 8000
    assert named(docs, "Service", "kvrelay-proxy")["spec"]["ports"][0]["port"] == 8000
    # side channels: the prefill listens on 5559 (declared), the decode is told 5659
    assert port_named(prefill, "kv-side-0") == 5559
    side = {e["name"]: e.get("value") for e in decode["env"]}
    assert side["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5659"
    prefill_env = {e["name"]: e for e in prefill["env"]}
    assert prefill_env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == "5559"
    # bound to and advertised as the pod's own IP
    assert prefill_env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["value"] == "$(POD_IP)"
    assert prefill_env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert "NEURON_VISIBLE_DEVICES" not in prefill_env        # the scheduler picks the devices


def test_2p1d_proxy_backends_are_pod_names_rendered_services_publish(capsys):
    from kvrelay.proxy.main import _Parser, add_proxy_flags
    from kvrelay.proxy.routing import expand_endpoints
    docs = emit(capsys, *TUTORIAL, "--prefill", "2", "--devices", "0-63", *EMIT)
    for d in docs:
        validate(d)
    proxy = named(docs, "Deployment", "kvrelay-proxy")["spec"]["template"]["spec"]
    args = proxy["containers"][0]["args"]
    assert args[0] == "proxy"
    parser = _Parser(prog="kvrelay proxy")
    add_proxy_flags(parser)
    ns = parser.parse_args(args[1:])
    prefill = expand_endpoints(ns.prefiller_host, ns.prefiller_port, "prefiller")
    decode = expand_endpoints(ns.decoder_host, ns.decoder_port, "decoder")
    assert len(prefill) == 2 and len(decode) == 1
    sts = named(docs, "StatefulSet", "kvrelay-prefill")["spec"]
    assert sts["replicas"] == 2
    assert sts["podManagementPolicy"] == "Parallel"     # all at once, as deploy starts them
    for host, port in prefill + decode:
        pod, svc, namespace, suffix = host.split(".")
        assert (namespace, suffix) == (NS, "svc")
        service = named(docs, "Service", svc)["spec"]
        assert service["clusterIP"] == "None"                # a DNS name per pod
        workload = named(docs, "StatefulSet", svc)
        assert workload["spec"]["serviceName"] == svc
        index = int(pod.removeprefix(f"{svc}-"))
        assert 0 <= index < workload["spec"]["replicas"]
        template = workload["spec"]["template"]
        assert service["selector"].items() <= template["metadata"]["labels"].items()
        assert port == port_named(template["spec"]["containers"][0], "http")


def test_a_server_larger_than_a_pod_is_a_leaderworkerset_group(capsys):
    """The tutorial's 16 × TP4 prefill + TP8 DP8 decode on nodes of 8 GPUs: each prefill
    server is a pod of 4, the decode server a group of 8 pods, one DP replica each."""
    docs = emit(capsys, *TUTORIAL, "--prefill", "16", "--devices", "0-7", *EMIT)
    for d in docs:
        validate(d)
    assert named(docs, "StatefulSet", "kvrelay-prefill")["spec"]["replicas"] == 16
    lws = named(docs, "LeaderWorkerSet", "kvrelay-decode")
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert (lws["spec"]["replicas"], lwt["size"]) == (1, 8)
    leader = lwt["leaderTemplate"]["spec"]["containers"][0]
    worker = lwt["workerTemplate"]["spec"]["containers"][0]
    head = engine_args(serve_args(leader))
    assert (head.data_parallel_size, head.local_replicas, head.headless) == (8, 1, False)
    assert head.data_parallel_address == "10.0.0.5"
    ranks = [0]
    for w in range(1, lwt["size"]):
        node = engine_args(serve_args(worker, w))
        assert node.headless and node.data_parallel_address.startswith("kvrelay-decode-0.")
        assert node.data_parallel_rpc_port == head.data_parallel_rpc_port
        ranks += range(node.data_parallel_start_rank,
                       node.data_parallel_start_rank + node.local_replicas)
    assert sorted(ranks) == list(range(8))                  # every replica exactly once
    for c in (leader, worker):
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert "readinessProbe" not in worker                   # no HTTP server on a headless node
    assert "annotations" not in lwt["workerTemplate"]["metadata"]      # nothing to scrape
    assert port_named(leader, "dp-rpc") == head.data_parallel_rpc_port
    # the proxy reaches the group's leader under the rendered headless Service
    proxy = named(docs, "Deployment", "kvrelay-proxy")["spec"]["template"]["spec"]
    assert flag(proxy["containers"][0]["args"], "--decoder-host") == [
        "kvrelay-decode-0.kvrelay-decode.llm.svc"]
    service = named(docs, "Service", "kvrelay-decode")["spec"]
    assert service["clusterIP"] == "None"
    leader_labels = lwt["leaderTemplate"]["metadata"]["labels"] | {
        "leaderworkerset.sigs.k8s.io/worker-index": "0"}        # what LWS adds to a leader
    assert service["selector"].items() <= leader_labels.items()


def test_two_replicas_per_pod_split_the_ranks(capsys):
    docs = emit(capsys, "--model", "openai/gpt-oss-20b", "--prefill", "1", "--prefill-tp", "4",
                "--decode", "1", "--decode-tp", "4", "--decode-dp", "4", "--devices", "0-7",
                *EMIT)
    lwt = named(docs, "LeaderWorkerSet", "kvrelay-decode")["spec"]["leaderWorkerTemplate"]
    assert lwt["size"] == 2
    worker = engine_args(serve_args(lwt["workerTemplate"]["spec"]["containers"][0], 1))
    assert (worker.data_parallel_start_rank, worker.local_replicas) == (2, 2)
    leader = lwt["leaderTemplate"]["spec"]["containers"][0]
    assert engine_args(serve_args(leader)).local_replicas == 2


def test_a_yaml_topology_with_kvrelay_plans_numbers(capsys, tmp_path):
    """What `kvrelay plan` recommends (servers per role, their --max-num-seqs) in a topology
    file; its `devices:` sizes the pods as --devices does."""
    topo = tmp_path / "topo.yaml"
    topo.write_text("model: openai/gpt-oss-20b\ndevices: 0-7\n"
                    "prefill: {count: 3, tp: 4, max_num_seqs: 2}\n"
                    "decode: {count: 2, tp: 8, dp: 4, enable_expert_parallel: true, "
                    "max_num_seqs: 16}\n")
    docs = emit(capsys, "--config", str(topo), *EMIT)
    for d in docs:
        validate(d)
    prefill = named(docs, "StatefulSet", "kvrelay-prefill")["spec"]
    assert prefill["replicas"] == 3
    assert engine_args(prefill["template"]["spec"]["containers"][0]["args"]).max_num_seqs == 2
    lws = named(docs, "LeaderWorkerSet", "kvrelay-decode")["spec"]
    assert (lws["replicas"], lws["leaderWorkerTemplate"]["size"]) == (2, 4)
    leader = lws["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    assert engine_args(serve_args(leader)).max_num_seqs == 16
    proxy = named(docs, "Deployment", "kvrelay-proxy")["spec"]["template"]["spec"]
    assert flag(proxy["containers"][0]["args"], "--decoder-host") == [
        f"kvrelay-decode-{g}.kvrelay-decode.llm.svc" for g in range(2)]


def test_a_single_instance_is_a_deployment_behind_a_clusterip(capsys):
    docs = emit(capsys, "--model", "openai/gpt-oss-120b", "-tp", "8", "--devices", "0-7", *EMIT)
    assert [d["kind"] for d in docs] == ["Service", "Deployment"]      # no KV plane, no proxy
    for d in docs:
        validate(d)
    service, deployment = docs
    assert service["spec"]["ports"][0]["port"] == 8000 and "clusterIP" not in service["spec"]
    c = deployment["spec"]["template"]["spec"]["containers"][0]
    assert engine_args(c["args"]).kv_transfer_config is None
    assert port_named(c, "http") == 8000


# ---------------------------------------------------------------------------- the KV secret

def secret_value(docs: list[dict]) -> str:
    data = by_kind(docs, "Secret")[0]["data"]
    return base64.b64decode(data["kv-secret"]).decode()


def literals(container: dict) -> list[str]:
    """Every string a container's command, arguments and environment spell out."""
    env = [e.get("value", "") for e in container.get("env", [])]
    return [*container.get("command", []), *container["args"], *env]


def test_the_secret_reaches_servers_only_as_a_mounted_file(capsys, tmp_path, monkeypatch):
    from kvrelay.disagg.auth import load_secret
    docs = one_p_one_d(capsys)
    secret = secret_value(docs)
    assert len(secret) == 64
    assert secret_value(one_p_one_d(capsys)) != secret        # a new one each rendering
    monkeypatch.delenv("KVRELAY_KV_SECRET", raising=False)
    servers = [(c, spec) for _, c, spec in containers(docs) if c["args"][0] == "serve"]
    assert len(servers) == 2
    for c, spec in servers:
        assert not any(secret in text for text in literals(c))
        config = engine_args(c["args"]).kv_transfer_config
        path = config["kv_connector_extra_config"]["secret_file"]
        mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])["secret"]
        assert volume["secretName"] == "kvrelay-kv-secret" and volume["defaultMode"] == 0o400
        key = path.removeprefix(mount["mountPath"] + "/")
        assert [i["key"] for i in volume["items"] if i["path"] == key] == ["kv-secret"]
        # what the server reads from that file is the Secret's value
        (tmp_path / key).write_text(secret)
        assert load_secret({"secret_file": str(tmp_path / key)}) == secret.encode()
    proxy = named(docs, "Deployment", "kvrelay-proxy")["spec"]["template"]["spec"]
    assert not any(secret in text for text in literals(proxy["containers"][0]))
    assert "volumes" not in proxy                             # the proxy has no KV secret


def test_a_given_secret_file_or_existing_secret(capsys, tmp_path):
    given = tmp_path / "kv.secret"
    given.write_text("correct-horse-battery-staple\n")
    docs = one_p_one_d(capsys, "--kv-secret-file", str(given))
    assert secret_value(docs) == "correct-horse-battery-staple"
    for _, c, _ in containers(docs):
        assert not any("correct-horse" in text for text in literals(c))
    docs = one_p_one_d(capsys, "--k8s-existing-secret", "team-kv")
    assert not by_kind(docs, "Secret")
    names = {v["secret"]["secretName"] for _, _, spec in containers(docs)
             for v in spec.get("volumes", []) if "secret" in v}
    assert names == {"team-kv"}


# ---------------------------------------------------------------------------- probes, resources

def test_probes_hit_health_on_the_servers_port(capsys):
    docs = emit(capsys, *TUTORIAL, "--prefill", "2", "--devices", "0-63", *EMIT)
    servers = [c for _, c, _ in containers(docs) if c["args"][0] == "serve"]
    assert len(servers) == 2
    for c in servers:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = c[probe]["httpGet"]
            assert get["path"] == "/health"
            assert port_named(c, get["port"]) == int(flag(c["args"], "--port")[0])
        startup = c["startupProbe"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        # model load and compilation: the servers' own limit first, then the probe's
        allowed = startup["periodSeconds"] * startup["failureThreshold"]
        assert allowed > float(env["VLLM_ENGINE_READY_TIMEOUT_S"]) == 5400
    proxy = named(docs, "Deployment", "kvrelay-proxy")["spec"]["template"]["spec"]
    for probe in ("readinessProbe", "livenessProbe"):
        # not /health: the proxy's is 503 while any one backend is down
        assert proxy["containers"][0][probe]["httpGet"] == {"path": "/metrics", "port": "http"}


def test_resources_labels_and_scrape_annotations(capsys):
    docs = one_p_one_d(capsys)
    for d in docs:
        labels = d["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "kvrelay"
        assert labels["app.kubernetes.io/instance"] == "kvrelay"
        assert labels["app.kubernetes.io/managed-by"] == "kvrelay-deploy"
    for _, t in [wt for d in docs for wt in pod_templates(d)]:
        ann = t["metadata"]["annotations"]
        c = t["spec"]["containers"][0]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
        assert int(ann["prometheus.io/port"]) == port_named(c, "http")
    prefill = named(docs, "StatefulSet", "kvrelay-prefill")["spec"]["template"]["spec"]
    res = prefill["containers"][0]["resources"]
    assert res["requests"] == res["limits"]                    # Guaranteed QoS
    assert (res["limits"]["cpu"], res["limits"]["nvidia.com/gpu"]) == ("4", "4")


def test_cpu_servers_ask_for_no_gpu_and_memory_for_their_weights(capsys):
    docs = one_p_one_d(capsys, "--", "--device", "cpu")
    prefill = named(docs, "StatefulSet", "kvrelay-prefill")["spec"]["template"]["spec"]
    limits = prefill["containers"][0]["resources"]["limits"]
    assert "nvidia.com/gpu" not in limits
    # gpt-oss-120b: about 61 GiB of MXFP4 experts + 4 GiB of bf16 dense layers
    assert 64 <= int(limits["memory"].removesuffix("Gi")) <= 80
    docs = one_p_one_d(capsys, "--k8s-memory", "200Gi", "--", "--device", "cpu")
    decode = named(docs, "StatefulSet", "kvrelay-decode")["spec"]["template"]["spec"]
    assert decode["containers"][0]["resources"]["limits"]["memory"] == "200Gi"


# ---------------------------------------------------------------------------- the schema bites

def test_an_invalid_manifest_fails_validation(capsys):
    """The check above can fail: a port given as a number string, and a misspelt field."""
    sts = named(one_p_one_d(capsys), "StatefulSet", "kvrelay-prefill")
    validate(sts)
    sts["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "8100"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(sts)
    svc = named(one_p_one_d(capsys), "Service", "kvrelay-decode")
    svc["spec"]["publishNotReadyAdresses"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(svc)


# ---------------------------------------------------------------------------- output, errors

def test_output_dir_has_one_object_per_file_and_a_private_secret(capsys, tmp_path):
    given = tmp_path / "kv.secret"
    given.write_text("s3cret")
    out = tmp_path / "manifests"
    assert main([*TUTORIAL, "--prefill", "1", "--devices", "0-63", *EMIT,
                 "--kv-secret-file", str(given), "--output-dir", str(out)]) == 0
    listed = capsys.readouterr().out.split()
    files = sorted(out.iterdir())
    assert [str(f) for f in files] == listed and len(files) == 7
    docs = [yaml.safe_load(f.read_text()) for f in files]
    assert docs == one_p_one_d(capsys, "--kv-secret-file", str(given))
    secret_file = next(f for f in files if "secret" in f.name)
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600


@pytest.mark.parametrize("argv, code, says", [
    (["--prefill", "1", "--emit", "k8s", "--k8s-image", IMAGE], 2, "say where the model is"),
    (["--prefill", "1", "--emit", "k8s", "--k8s-model-pvc", "m"], 2, "--k8s-image"),
    (["--prefill", "1", "--k8s-image", IMAGE], 2, "--k8s-image is for --emit k8s"),
    (["--prefill", "1", "--dry-run", *EMIT], 2, "choose one"),
    (["--prefill", "1", "--devices", "0-3", *EMIT], 1, "TP group of 8 ranks does not fit"),
    (["--prefill", "1", "--devices", "0-63", *EMIT, "--k8s-name", "Bad_Name"], 1, "DNS label"),
    (["--prefill", "1", "--devices", "0-63", *EMIT, "--kv-secret-file", "/nonexistent/kv"], 1,
     "--kv-secret-file"),
])
def test_errors_are_one_line(capsys, argv, code, says):
    assert main([*TUTORIAL, *argv]) == code
    out = capsys.readouterr()
    assert out.out == ""
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvrelay deploy: error: ")
    assert says in lines[0]
