"""`kvrelay deploy --emit k8s`: the topology `kvrelay deploy` stands up on one host, rendered as
Kubernetes manifests (docs/cluster.md, "Kubernetes").

The servers run the same `kvrelay serve` commands as the local deploy (`plan.py` builds them),
with what changes when every server is a pod of its own:

    object                      what it holds
    Secret <name>-kv-secret     the KV secret, key `kv-secret`, mounted as a file and read
                                through kv_connector_extra_config.secret_file (never an env
                                literal, never an argument)
    StatefulSet <name>-prefill  one pod per prefill server (replicas = --prefill); a headless
    Service     <name>-prefill  Service gives each pod a name: <name>-prefill-<i>.<name>-prefill
    StatefulSet <name>-decode   the same for decode
    Service     <name>-decode
    Deployment  <name>-proxy    `kvrelay proxy`, given every prefill and decode pod by its name
    Service     <name>-proxy    ClusterIP on the proxy's port: what clients use

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

import argparse
import base64
import json
import math
import os
import re
import secrets
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import kvrelay
from kvrelay import envs
from kvrelay.deploy.launcher import STOP_GRACE_S
from kvrelay.deploy.plan import (
    KV_SECRET_ENV,
    Plan,
    ServerPlan,
    kv_buffer_device,
    make_plan,
)
from kvrelay.deploy.shapes import BUILTIN_CONFIGS
from kvrelay.deploy.topology import RoleSpec, TopologyError, load_yaml

Manifest = dict[str, Any]

MODEL_MOUNT = "/model"                      # the checkpoint directory inside every server pod
SECRET_DIR = "/etc/kvrelay/kv"
SECRET_KEY = "kv-secret"
CACHE_DIR = "/var/cache/kvrelay"            # KVRELAY_CACHE_DIR: vocabulary, native kernels
DP_RPC_PORT = 29550                         # --data-parallel-rpc-port of a multi-pod server
LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"    # "0": a group's leader
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


# ---------------------------------------------------------------------------- rendering

def render(plan: Plan, opts: K8sOptions) -> list[Manifest]:
    """Every object of the topology, in the order `kubectl apply` should create them."""
    if any(name == KV_SECRET_ENV for name, _ in plan.topology.env):
        raise K8sError(f"env: {KV_SECRET_ENV} would put the KV secret in the pod spec; use "
                       "--kv-secret-file or --k8s-existing-secret")
    pods = pod_plan(plan)
    roles = role_pods(pods, opts.devices_per_pod)
    r = _Renderer(pods, opts)
    out: list[Manifest] = []
    if pods.topology.disaggregated and opts.existing_secret is None:
        out.append(r.secret(opts.kv_secret or secrets.token_hex(32)))
    for role in roles:
        out += [r.service(role), r.workload(role)]
    if pods.proxy is not None:
        out += r.proxy(roles)
    return out


class _Renderer:
    """Builds the objects of one rendering from the pods' plan and the options (it keeps no
    state of its own)."""

    def __init__(self, plan: Plan, opts: K8sOptions) -> None:
        self.plan, self.opts = plan, opts

    # -- metadata -------------------------------------------------------------------------
    def name(self, component: str) -> str:
        return f"{self.opts.name}-{component}"

    def selector(self, component: str) -> dict[str, str]:
        return {"app.kubernetes.io/name": "kvrelay", "app.kubernetes.io/instance": self.opts.name,
                "app.kubernetes.io/component": component}

    def labels(self, component: str) -> dict[str, str]:
        return self.selector(component) | {"app.kubernetes.io/part-of": "kvrelay",
                                           "app.kubernetes.io/version": kvrelay.__version__,
                                           "app.kubernetes.io/managed-by": "kvrelay-deploy"}

    def meta(self, component: str) -> dict[str, Any]:
        return {"name": self.name(component), "namespace": self.opts.namespace,
                "labels": self.labels(component)}

    def template_meta(self, component: str, port: int) -> dict[str, Any]:
        return {"labels": self.labels(component),
                "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                                "prometheus.io/path": "/metrics"}}

    # -- objects --------------------------------------------------------------------------
    def secret(self, value: str) -> Manifest:
        return {"apiVersion": "v1", "kind": "Secret", "metadata": self.meta("kv-secret"),
                "type": "Opaque",
                "data": {SECRET_KEY: base64.b64encode(value.encode()).decode()}}

    def service(self, role: RolePods) -> Manifest:
        """Headless for prefill/decode (a DNS name per pod, published before the pod is
        ready so the proxy's health checks see the server's own answer); ClusterIP for a
        single instance (one server: nothing to address per pod)."""
        component = role.object_name
        spec: dict[str, Any] = {
            "selector": self.selector(component),
            "ports": [{"name": "http", "port": role.server.port, "targetPort": "http"}]}
        if role.spec.role != "single" or role.kind == "LeaderWorkerSet":
            spec |= {"clusterIP": "None", "publishNotReadyAddresses": True}
        if role.kind == "LeaderWorkerSet":      # the leaders: the pods that serve HTTP
            spec["selector"] = spec["selector"] | {LWS_WORKER_INDEX_LABEL: "0"}
        return {"apiVersion": "v1", "kind": "Service", "metadata": self.meta(component),
                "spec": spec}

    def workload(self, role: RolePods) -> Manifest:
        component = role.object_name
        meta = self.meta(component)
        template = {"metadata": self.template_meta(component, role.server.port),
                    "spec": self.server_pod(role, leader=True)}
        if role.kind == "Deployment":
            # Recreate: a rolling update of the one server would need its devices twice
            return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
                    "spec": {"replicas": 1, "strategy": {"type": "Recreate"},
                             "selector": {"matchLabels": self.selector(component)},
                             "template": template}}
        if role.kind == "StatefulSet":
            return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta,
                    "spec": {"replicas": role.spec.count, "serviceName": meta["name"],
                             "podManagementPolicy": "Parallel",
                             "selector": {"matchLabels": self.selector(component)},
                             "template": template}}
        # a worker serves no HTTP, so no /metrics to scrape: its replicas' numbers are the
        # leader's (the head collects every replica's)
        worker = {"metadata": {"labels": self.labels(component)},
                  "spec": self.server_pod(role, leader=False)}
        return {"apiVersion": LWS_API, "kind": "LeaderWorkerSet", "metadata": meta,
                "spec": {"replicas": role.spec.count, "startupPolicy": "LeaderCreated",
                         "leaderWorkerTemplate": {
                             "size": role.pods_per_server,
                             "restartPolicy": "RecreateGroupOnPodRestart",
                             "leaderTemplate": template, "workerTemplate": worker}}}

    def proxy(self, roles: list[RolePods]) -> list[Manifest]:
        proxy = self.plan.proxy
        assert proxy is not None
        meta = self.meta("proxy")
        container = {
            "name": "proxy", "image": self.opts.image, "command": ["kvrelay"],
            "args": proxy_args(self.plan, roles, self.opts),
            "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
            "ports": [{"name": "http", "containerPort": proxy.port}],
            **proxy_probes(),
            "resources": {"requests": {"cpu": "1", "memory": "1Gi"},
                          "limits": {"memory": "2Gi"}}}
        deployment = {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
            "spec": {"replicas": 1, "selector": {"matchLabels": self.selector("proxy")},
                     "template": {"metadata": self.template_meta("proxy", proxy.port),
                                  "spec": {"containers": [container]}}}}
        service = {"apiVersion": "v1", "kind": "Service", "metadata": meta,
                   "spec": {"type": "ClusterIP", "selector": self.selector("proxy"),
                            "ports": [{"name": "http", "port": proxy.port,
                                       "targetPort": "http"}]}}
        return [service, deployment]

    # -- the server pod -------------------------------------------------------------------
    def server_pod(self, role: RolePods, leader: bool) -> dict[str, Any]:
        s = role.server
        container: dict[str, Any] = {"name": "kvrelay", "image": self.opts.image}
        container |= server_command(self.plan, role, leader)
        container["env"] = server_env(self.plan, s)
        ports = [{"name": "http", "containerPort": s.port}] if leader else []
        ports += [{"name": f"kv-side-{i}", "containerPort": p}
                  for i, p in enumerate(_side_ports(role, leader))]
        if role.pods_per_server > 1 and leader:
            ports.append({"name": "dp-rpc", "containerPort": DP_RPC_PORT})
        if ports:
            container["ports"] = ports
        if leader:                        # a --headless worker has no HTTP server
            container |= server_probes(self.plan)
        container["resources"] = self.resources(role)
        volumes, container["volumeMounts"] = self.volumes()
        # serve drains in-flight requests for up to 30 s after SIGTERM
        return {"terminationGracePeriodSeconds": int(STOP_GRACE_S) + 10,
                "containers": [container], "volumes": volumes}

    def volumes(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(volumes, mounts): the model read-only at MODEL_MOUNT, a cache for the vocabulary
        and the native kernels, shared memory, and the KV secret as a file readable by the
        server only."""
        claim, _, sub_path = (self.opts.model_pvc or "").partition(":")
        model: dict[str, Any] = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
        if sub_path:
            model["subPath"] = sub_path
        volumes: list[dict[str, Any]] = [
            {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
            if claim else
            {"name": "model", "hostPath": {"path": self.opts.model_host_path,
                                           "type": "Directory"}},
            {"name": "cache", "emptyDir": {}},
            {"name": "dshm", "emptyDir": {"medium": "Memory"}}]
        mounts = [model, {"name": "cache", "mountPath": CACHE_DIR},
                  {"name": "dshm", "mountPath": "/dev/shm"}]
        if self.plan.topology.disaggregated:
            volumes.append({"name": "kv-secret", "secret": {
                "secretName": self.opts.secret_name, "defaultMode": 0o400,
                "items": [{"key": SECRET_KEY, "path": SECRET_KEY}]}})
            mounts.append({"name": "kv-secret", "mountPath": SECRET_DIR, "readOnly": True})
        return volumes, mounts

    def resources(self, role: RolePods) -> dict[str, Any]:
        """requests = limits (Guaranteed QoS: with the static CPU manager the pod gets whole
        cores of its own, which kvrelay's one-thread-per-rank pinning wants)."""
        amounts = {"cpu": str(role.ranks_per_pod),
                   "memory": self.opts.memory or f"{pod_memory_gib(self.plan, role)}Gi"}
        if role.device == "cuda":
            amounts["nvidia.com/gpu"] = str(role.ranks_per_pod)
        return {"requests": dict(amounts), "limits": dict(amounts)}


def _side_ports(role: RolePods, leader: bool) -> list[int]:
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


# ---------------------------------------------------------------------------- output

def to_yaml(manifests: list[Manifest]) -> str:
    """One YAML stream: keys in the order written, a JSON argument on one line, no anchors
    (a probe's httpGet shared by three probes is written out three times)."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return yaml.dump_all(manifests, Dumper=Dumper, sort_keys=False, width=1 << 16)


def write_dir(manifests: list[Manifest], directory: Path) -> list[Path]:
    """One file per object, numbered in apply order; the Secret's readable by its owner only."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, m in enumerate(manifests):
        path = directory / f"{i:02d}-{m['kind'].lower()}-{m['metadata']['name']}.yaml"
        mode = 0o600 if m["kind"] == "Secret" else 0o644
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        os.fchmod(fd, mode)                 # a file left from an earlier run keeps no other mode
        with os.fdopen(fd, "w") as f:
            f.write(to_yaml([m]))
        paths.append(path)
    return paths


def summary(plan: Plan, manifests: list[Manifest]) -> str:
    kinds = ", ".join(f"{m['kind']} {m['metadata']['name']}" for m in manifests)
    out = f"# kvrelay deploy --emit k8s: {plan.served_name}: {kinds}\n"
    if any(m["kind"] == "Secret" for m in manifests):
        out += "# The Secret holds the topology's KV secret: keep this output private.\n"
    return out


# ---------------------------------------------------------------------------- the CLI

def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Kubernetes manifests (--emit k8s; docs/cluster.md)")
    g.add_argument("--emit", choices=("k8s",), default=None,
                   help="print the topology as Kubernetes manifests instead of starting it")
    g.add_argument("--output-dir", type=Path, default=None, metavar="DIR",
                   help="one file per object in DIR (default: one YAML stream on stdout)")
    g.add_argument("--k8s-image", default=None, metavar="IMAGE",
                   help="container image with kvrelay installed (required)")
    g.add_argument("--k8s-model-pvc", default=None, metavar="NAME[:SUBPATH]",
                   help="the checkpoint directory: a PersistentVolumeClaim (and the directory "
                        "in it)")
    g.add_argument("--k8s-model-host-path", default=None, metavar="PATH",
                   help="the checkpoint directory: a path on every node")
    g.add_argument("--k8s-namespace", default=None, metavar="NS",
                   help="namespace of every object (default: default)")
    g.add_argument("--k8s-name", default=None, metavar="NAME",
                   help="prefix of every object's name (default: kvrelay)")
    g.add_argument("--kv-secret-file", type=Path, default=None, metavar="FILE",
                   help="the KV secret for the rendered Secret (default: a new random one)")
    g.add_argument("--k8s-existing-secret", default=None, metavar="NAME",
                   help=f"use this Secret (key {SECRET_KEY}) instead of rendering one")
    g.add_argument("--k8s-devices-per-pod", type=int, default=None, metavar="N",
                   help="devices of one pod; a larger server spans a LeaderWorkerSet group "
                        "(default: --devices' count when given, else one pod per server)")
    g.add_argument("--k8s-memory", default=None, metavar="SIZE",
                   help="memory of each server pod, e.g. 96Gi (default: an estimate)")


_K8S_FLAGS = ("output_dir", "k8s_image", "k8s_model_pvc", "k8s_model_host_path", "k8s_namespace",
              "k8s_name", "kv_secret_file", "k8s_existing_secret", "k8s_devices_per_pod",
              "k8s_memory")


def flag_problem(args: argparse.Namespace) -> str | None:
    """Flags that cannot go together, found before the plan is made."""
    if args.emit is None:
        given = [f for f in _K8S_FLAGS if getattr(args, f) is not None]
        return f"--{given[0].replace('_', '-')} is for --emit k8s" if given else None
    if args.dry_run:
        return "--emit and --dry-run: choose one (both start nothing)"
    if not args.k8s_image:
        return "--emit k8s needs --k8s-image IMAGE (an image with kvrelay installed)"
    if (args.k8s_model_pvc is None) == (args.k8s_model_host_path is None):
        return MODEL_WHERE
    return None


def options_from_args(args: argparse.Namespace, plan: Plan) -> K8sOptions:
    secret = None
    if args.kv_secret_file is not None:
        try:
            secret = args.kv_secret_file.read_text().strip()
        except OSError as e:
            raise K8sError(f"--kv-secret-file {args.kv_secret_file}: {e.strerror}") from None
        if not secret:
            raise K8sError(f"--kv-secret-file {args.kv_secret_file}: empty")
    per_pod = args.k8s_devices_per_pod
    if per_pod is None and _devices_named(args):
        per_pod = len(plan.topology.devices)
    return K8sOptions(image=args.k8s_image, namespace=args.k8s_namespace or "default",
                      name=args.k8s_name or "kvrelay", model_pvc=args.k8s_model_pvc,
                      model_host_path=args.k8s_model_host_path, kv_secret=secret,
                      existing_secret=args.k8s_existing_secret, devices_per_pod=per_pod,
                      memory=args.k8s_memory)


def _devices_named(args: argparse.Namespace) -> bool:
    """--devices (or the YAML's devices:) says how many devices a host, so a pod, has; without
    it the topology's devices are this machine's cores, which say nothing about the nodes."""
    if args.devices is not None:
        return True
    if args.config is None:
        return False
    return "devices" in load_yaml(args.config)


def emit(plan: Plan, args: argparse.Namespace) -> int:
    """Render and print (or write) the manifests; 0, or 1 with one line saying why not."""
    if args.engine_ready_timeout is not None:
        name = str(envs.ENGINE_READY_TIMEOUT_S.alias)
        plan = replace(plan, exports=tuple(kv for kv in plan.exports if kv[0] != name)
                       + ((name, f"{args.engine_ready_timeout:g}"),))
    try:
        manifests = render(plan, options_from_args(args, plan))
        warnings = pod_plan(plan).warnings      # the layout's, not one host's device slices
    except (K8sError, TopologyError) as e:
        sys.stderr.write(f"kvrelay deploy: error: {' '.join(str(e).splitlines())}\n")
        return 1
    for warning in warnings:
        sys.stderr.write(f"kvrelay deploy: warning: {warning}\n")
    if args.output_dir is not None:
        for path in write_dir(manifests, args.output_dir):
            sys.stdout.write(f"{path}\n")
        return 0
    sys.stdout.write(summary(plan, manifests) + to_yaml(manifests))
    return 0
