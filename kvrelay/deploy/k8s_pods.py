"""`kvrelay deploy --emit k8s`, the pods: how each server of the topology becomes one pod or
a LeaderWorkerSet group (`RolePods`), and what a pod runs: its command, environment, probes
and memory. k8s.py renders the objects around them.

- Per-pod names, not one Service address per role: the proxy routes by server (cache-aware
  routing, per-server health and load from each one's /health and /metrics), so it must reach
  each pod; behind a ClusterIP it would see one server and kube-proxy would pick the pod.
- A server whose ranks do not fit one pod (`--k8s-devices-per-pod`, else the topology's
  `--devices` per host) becomes a LeaderWorkerSet group: the leader runs the API server and the
  first DP replicas, each worker `--headless` the next ones (kvrelay spans nodes by data-parallel
  replicas, never inside a TP group):

        decode TP8 DP8 on pods of 8 devices: one group of 8 pods
        leader  <name>-decode-0      replica 0 and the API server, listening for the workers
                                     on --data-parallel-address $(POD_IP)
        worker  <name>-decode-0-<w>  replica w, --headless, dials $(LWS_LEADER_ADDRESS)

- Every pod of a role listens on the role's first port (each pod has an address of its own):
  prefill 8100, decode 8200, the proxy 8000, side channels 5559 (prefill; + DP rank).
- The prefill's side channel binds and advertises the pod's IP (status.podIP), the address
  decode pods dial (kv_transfer_params are signed: it must be right at the source).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from typing import Any

from kvrelay import envs
from kvrelay.deploy.layout import Plan, ServerPlan, kv_buffer_device, make_plan
from kvrelay.deploy.shapes import BUILTIN_CONFIGS
from kvrelay.deploy.topology import RoleSpec

MODEL_MOUNT = "/model"                      # the checkpoint directory inside every server pod
SECRET_DIR = "/etc/kvrelay/kv"
SECRET_KEY = "kv-secret"
CACHE_DIR = "/var/cache/kvrelay"            # KVRELAY_CACHE_DIR: vocabulary, native kernels
DP_RPC_PORT = 29550                         # --data-parallel-rpc-port of a multi-pod server
GIB = 1 << 30
# host memory of one rank besides the weights: Python, torch, the engine (CPU); with CUDA
# also the CUDA context and the staging of the weights on their way to the GPU
HOST_BYTES_PER_RANK = {"cpu": 1 * GIB, "cuda": 4 * GIB}
MXFP4_BYTES_PER_WEIGHT = 17 / 32            # 16 bytes of 4-bit values + 1 scale per 32 weights
PROBE_PERIOD_S = 10
MODEL_WHERE = ("say where the model is: --k8s-model-pvc NAME[:SUBPATH] or --k8s-model-host-path "
               "PATH (one of them; the checkpoint directory every server pod mounts)")
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")                 # DNS-1123 label
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


class K8sError(ValueError):
    """A topology or flag the manifests cannot express: one line for the CLI."""


@dataclass(frozen=True)
class K8sOptions:
    """Where the cluster differs from one host: the image, the model's volume, the secret."""

    image: str
    namespace: str = "default"
    name: str = "kvrelay"                   # prefix of every object (app.kubernetes.io/instance)
    model_pvc: str | None = None            # PVC name, or NAME:SUBPATH
    model_host_path: str | None = None      # a directory on every node
    kv_secret: str | None = None            # the rendered Secret's value (None: a new one)
    existing_secret: str | None = None      # a Secret of the cluster's instead (key kv-secret)
    devices_per_pod: int | None = None      # None: every server in one pod
    memory: str | None = None               # per server pod (None: estimated)

    def __post_init__(self) -> None:
        if not self.image or any(c.isspace() for c in self.image):
            raise K8sError(f"--k8s-image {self.image!r}: expected an image reference")
        _check_label("--k8s-namespace", self.namespace, 63)
        _check_label("--k8s-name", self.name, 40)      # room for -prefill-15, -decode-0-7
        if (self.model_pvc is None) == (self.model_host_path is None):
            raise K8sError(MODEL_WHERE)
        if self.model_pvc is not None and not _SUBDOMAIN.match(self.model_pvc.split(":")[0]):
            raise K8sError(f"--k8s-model-pvc {self.model_pvc!r}: expected a PVC name")
        if self.model_host_path is not None and not self.model_host_path.startswith("/"):
            raise K8sError(f"--k8s-model-host-path {self.model_host_path!r}: expected an "
                           "absolute path on the nodes")
        if self.existing_secret is not None and self.kv_secret is not None:
            raise K8sError("--kv-secret-file and --k8s-existing-secret: give one of them")
        if self.existing_secret is not None and not _SUBDOMAIN.match(self.existing_secret):
            raise K8sError(f"--k8s-existing-secret {self.existing_secret!r}: expected a "
                           "Secret name")
        if self.devices_per_pod is not None and self.devices_per_pod < 1:
            raise K8sError(f"--k8s-devices-per-pod {self.devices_per_pod}: expected a positive "
                           "integer")

    @property
    def secret_name(self) -> str:
        return self.existing_secret or f"{self.name}-kv-secret"


def _check_label(flag: str, value: str, longest: int) -> None:
    if not _NAME.match(value) or len(value) > longest:
        raise K8sError(f"{flag} {value!r}: expected a DNS label (a-z, 0-9, '-'; at most "
                       f"{longest} characters)")


@dataclass(frozen=True)
class RolePods:
    """How the servers of one role become pods: the same command in every pod (server 0's,
    every server of a role being identical but for what a pod of its own makes equal: the
    port, the side-channel port, the device slice)."""

    spec: RoleSpec
    server: ServerPlan                      # the pod template's command and environment
    pods_per_server: int                    # > 1: a LeaderWorkerSet group
    replicas_per_pod: int                   # DP replicas each pod runs
    device: str                             # cpu | cuda

    @property
    def object_name(self) -> str:
        return self.spec.role if self.spec.role != "single" else "serve"

    @property
    def kind(self) -> str:
        if self.pods_per_server > 1:
            return "LeaderWorkerSet"
        return "Deployment" if self.spec.role == "single" else "StatefulSet"

    @property
    def ranks_per_pod(self) -> int:
        return self.spec.tp * self.replicas_per_pod


def split_over_pods(spec: RoleSpec, per_pod: int | None) -> tuple[int, int]:
    """(pods per server, DP replicas per pod): whole TP groups fill pods of `per_pod` devices.

        TP8 DP8 (64 ranks), pods of 8:   8 pods, replica r on pod r
        TP4 DP4 (16 ranks), pods of 8:   2 pods, replicas 0-1 | 2-3
        TP4 DP1, pods of 64:             1 pod
    """
    if per_pod is None or spec.ranks <= per_pod:
        return 1, spec.dp
    if spec.tp > per_pod:
        raise K8sError(f"{spec.role}: a TP group of {spec.tp} ranks does not fit a pod of "
                       f"{per_pod} devices (kvrelay spans pods by data-parallel replicas, not "
                       "inside a TP group): lower the TP size or raise --k8s-devices-per-pod")
    replicas = per_pod // spec.tp
    if spec.dp % replicas:
        raise K8sError(f"{spec.role}: DP{spec.dp} does not split into pods of {replicas} "
                       f"TP{spec.tp} replicas ({per_pod} devices per pod)")
    return spec.dp // replicas, replicas


# ---------------------------------------------------------------------------- the plan, as pods

def pod_plan(plan: Plan) -> Plan:
    """The plan again with every server on a host of its own: it listens on all interfaces,
    its KV buffer is on the servers' device (the passthrough --device, else cuda) rather than
    this machine's, and the device list is as long as the largest server (pods get their
    devices from the scheduler: no slices to share)."""
    topo = plan.topology
    roles = tuple(replace(r, hosts=tuple(f"{r.role}-{i}.pod" for i in range(r.count)))
                  for r in topo.roles)
    pods = replace(topo, roles=roles, proxy_host="proxy.pod",
                   devices=tuple(range(max(r.ranks for r in roles))))
    return make_plan(pods, plan.config)


def role_pods(plan: Plan, per_pod: int | None) -> list[RolePods]:
    out = []
    for spec in plan.topology.roles:
        server = plan.role_servers(spec.role)[0]
        pods, replicas = split_over_pods(spec, per_pod)
        out.append(RolePods(spec, server, pods, replicas, kv_buffer_device(plan.topology, spec)))
    return out


def pod_dns(obj: str, index: int, namespace: str) -> str:
    """Pod `index` of a StatefulSet, or the leader of LeaderWorkerSet group `index`: both are
    `<obj>-<index>` under a headless Service named `<obj>` (for a LeaderWorkerSet the
    Service its controller would create; rendered here so the name exists from the start)."""
    return f"{obj}-{index}.{obj}.{namespace}.svc"


# ---------------------------------------------------------------------------- a pod's container

def side_ports(role: RolePods, leader: bool) -> list[int]:
    """The KV side-channel ports a pod listens on: a prefill listens on its first port plus
    the DP rank of each replica it runs (the leader ranks [0, L), the workers the rest)."""
    if role.spec.role != "prefill":
        return []                          # a kv_consumer dials out; it listens on none
    first = role.server.side_channel_ports[0]
    ranks = range(role.replicas_per_pod) if leader else range(role.replicas_per_pod,
                                                               role.spec.dp)
    return [first + r for r in ranks]


def server_command(plan: Plan, role: RolePods, leader: bool) -> dict[str, Any]:
    """`kvrelay serve` as the local deploy runs it, with the model at MODEL_MOUNT, the KV secret
    read from its mounted file, and, for a group of pods, the multi-node data-parallel flags."""
    args = _pod_args(plan, role.server)
    if role.pods_per_server == 1:
        return {"command": ["kvrelay"], "args": args}
    args += ["--data-parallel-size-local", str(role.replicas_per_pod),
             "--data-parallel-rpc-port", str(DP_RPC_PORT)]
    if leader:
        return {"command": ["kvrelay"], "args": args + ["--data-parallel-address", "$(POD_IP)"]}
    # the worker's first replica rank is LWS_WORKER_INDEX × L: arithmetic needs a shell
    # ($$ is Kubernetes' escape for a literal $)
    script = (f'exec kvrelay "$@" --data-parallel-start-rank '
              f'"$$((LWS_WORKER_INDEX * {role.replicas_per_pod}))"')
    return {"command": ["/bin/sh", "-c", script, "kvrelay"],
            "args": args + ["--headless", "--data-parallel-address", "$(LWS_LEADER_ADDRESS)"]}


def _pod_args(plan: Plan, server: ServerPlan) -> list[str]:
    """The server's `serve MODEL …` with MODEL where the pod mounts the checkpoint, under the
    name the topology serves (so clients send the same model name as to the local deploy),
    and the KV secret's file in kv_connector_extra_config.secret_file."""
    args = list(server.args)
    if plan.topology.model:
        args[1] = MODEL_MOUNT
    else:                                        # the embedded model: its directory, built once
        args.insert(1, MODEL_MOUNT)
    if "--served-model-name" not in args:
        args[2:2] = ["--served-model-name", plan.served_name]
    if plan.topology.disaggregated:
        i = args.index("--kv-transfer-config") + 1
        config = json.loads(args[i])
        extra = config.setdefault("kv_connector_extra_config", {})
        extra["secret_file"] = f"{SECRET_DIR}/{SECRET_KEY}"
        args[i] = json.dumps(config)
    return args


def server_env(plan: Plan, server: ServerPlan) -> list[dict[str, Any]]:
    """The plan's variables, less the device slice (the scheduler gives the pod its devices),
    with the side channel bound to and advertised as the pod's own IP."""
    env: list[dict[str, Any]] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    skip = {"NEURON_VISIBLE_DEVICES", envs.SIDE_CHANNEL_HOST.alias, envs.SIDE_CHANNEL_HOST.name}
    for name, value in plan.exports + server.env:
        if name not in skip:
            env.append({"name": name, "value": value})
    if plan.topology.disaggregated:
        env.append({"name": str(envs.SIDE_CHANNEL_HOST.alias), "value": "$(POD_IP)"})
    env += [{"name": envs.CACHE_DIR.name, "value": CACHE_DIR},
            {"name": "PYTHONUNBUFFERED", "value": "1"}]
    return env


def server_probes(plan: Plan) -> dict[str, Any]:
    """/health answers 200 once the engine is ready. The startup probe allows the servers'
    own engine-ready limit (VLLM_ENGINE_READY_TIMEOUT_S: 5400 s with the tutorial's DI
    preset, compilation included) plus a minute, so a server says why it gave up first."""
    var, exported = envs.ENGINE_READY_TIMEOUT_S, dict(plan.exports)
    limit = float(exported.get(var.name) or exported.get(str(var.alias)) or var.default or 600)
    get = {"httpGet": {"path": "/health", "port": "http"}}
    return {
        "startupProbe": get | {"periodSeconds": PROBE_PERIOD_S,
                               "failureThreshold": math.ceil((limit + 60) / PROBE_PERIOD_S)},
        "readinessProbe": get | {"periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3},
        "livenessProbe": get | {"periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": 10,
                                "failureThreshold": 6}}


def proxy_probes() -> dict[str, Any]:
    """GET /metrics: the proxy's /health is 503 while any one server is down, which would take
    the only entry point out of its Service (or restart it) for one prefill pod's restart; the
    proxy routes around a server that is down by itself."""
    get = {"httpGet": {"path": "/metrics", "port": "http"}}
    return {"readinessProbe": get | {"periodSeconds": 5, "timeoutSeconds": 5},
            "livenessProbe": get | {"periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": 10,
                                    "failureThreshold": 6}}


def proxy_args(plan: Plan, roles: list[RolePods], opts: K8sOptions) -> list[str]:
    """Every prefill and decode server by its pod's DNS name, all on the role's port."""
    proxy = plan.proxy
    assert proxy is not None
    args = ["proxy", "--host", "0.0.0.0", "--port", str(proxy.port)]
    for role in roles:
        flag = {"prefill": "prefiller", "decode": "decoder"}[role.spec.role]
        obj = f"{opts.name}-{role.object_name}"
        args += [f"--{flag}-host", *(pod_dns(obj, i, opts.namespace)
                                     for i in range(role.spec.count))]
        args += [f"--{flag}-port", str(role.server.port)]
    return args + list(plan.topology.proxy_args)


# ---------------------------------------------------------------------------- memory

def weight_bytes(plan: Plan) -> tuple[int, int]:
    """(dense, expert) bytes of the checkpoint: the dense layers at the config's dtype, the
    experts at MXFP4's 4.25 bits when the checkpoint is MXFP4 (the published gpt-oss ones)."""
    c = plan.config
    dtype = 4 if c.torch_dtype == "float32" else 2
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = 2 * c.hidden_size * q + 2 * c.hidden_size * kv + c.hidden_size * c.num_local_experts
    dense = 2 * c.vocab_size * c.hidden_size + c.num_hidden_layers * layer
    experts = c.num_hidden_layers * c.num_local_experts * 3 * c.hidden_size * c.intermediate_size
    quant = (c.raw.get("quantization_config") or {}).get("quant_method")
    builtin = {plan.topology.model, plan.served_name} & set(BUILTIN_CONFIGS)
    per_expert_weight = MXFP4_BYTES_PER_WEIGHT if quant == "mxfp4" or builtin else dtype
    return dense * dtype, int(experts * per_expert_weight)


def pod_memory_gib(plan: Plan, role: RolePods) -> int:
    """Host memory of one server pod: per rank HOST_BYTES_PER_RANK; on CPU also the weights
    the pod's replicas hold (experts divided among replicas when they are spread across them)
    and the default KV budget of each replica. A starting point: `--k8s-memory` overrides."""
    total = role.ranks_per_pod * HOST_BYTES_PER_RANK[role.device]
    if role.device == "cpu":
        from kvrelay.config import DEFAULT_KV_BYTES
        dense, experts = weight_bytes(plan)
        spec, replicas = role.spec, role.replicas_per_pod
        across = spec.dp if spec.expert_parallel and spec.dp > 1 else 1
        total += dense * replicas + experts * replicas // across + DEFAULT_KV_BYTES * replicas
    return math.ceil(total / GIB)
