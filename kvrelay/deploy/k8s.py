"""`kvrelay deploy --emit k8s`: the topology `kvrelay deploy` stands up on one host, rendered as
Kubernetes manifests (docs/cluster.md, "Kubernetes").

The servers run the same `kvrelay serve` commands as the local deploy (`layout.py` builds them),
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

How servers become pods (per-pod names, LeaderWorkerSet groups, ports, the side channel's
address) and what each pod runs: k8s_pods.py.
"""
from __future__ import annotations

import argparse
import base64
import os
import secrets
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import kvrelay
from kvrelay import envs
from kvrelay.deploy.k8s_pods import (
    CACHE_DIR,
    DP_RPC_PORT,
    MODEL_MOUNT,
    MODEL_WHERE,
    SECRET_DIR,
    SECRET_KEY,
    K8sError,
    K8sOptions,
    RolePods,
    pod_memory_gib,
    pod_plan,
    proxy_args,
    proxy_probes,
    role_pods,
    server_command,
    server_env,
    server_probes,
    side_ports,
)
from kvrelay.deploy.launcher import STOP_GRACE_S
from kvrelay.deploy.layout import KV_SECRET_ENV, Plan
from kvrelay.deploy.topology import TopologyError, load_yaml

Manifest = dict[str, Any]

LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"    # "0": a group's leader


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
                  for i, p in enumerate(side_ports(role, leader))]
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
