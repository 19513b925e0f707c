"""Ray, for the executors that place work on a cluster (`--distributed-executor-backend ray`,
`--data-parallel-backend ray`): joining the cluster, placement groups, what an actor inherits.

kvrelay joins a running cluster and never starts one: `--ray-address`, else RAY_ADDRESS,
else `address="auto"` — which finds a cluster started on this host with `ray start --head`
and fails when there is none. Ray is an optional extra (`pip install 'kvrelay[ray]'`);
without it the flag is refused in one line.

What reaches an actor: its arguments (pickled by Ray: engine arguments, a `RankSpec`) and
the environment variables `actor_env` copies into its runtime_env (kvrelay's and the
tutorial's settings, the KV secret among them) — never a command line.
"""
from __future__ import annotations

import logging
import os
import socket
from typing import Any

from kvrelay import envs

logger = logging.getLogger(__name__)

NAMESPACE = "kvrelay"
# the settings an actor needs from this process's environment (same names on every node)
_ENV_PREFIXES = ("KVRELAY_", "VLLM_", "NEURON_", "GLOO_", "UCX_", "NIXL_", "HF_", "TORCH_")
_ENV_NAMES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OPENAI_API_KEY")
# Ray's own variables are Ray's business (an actor already runs inside the cluster)
_NOT_COPIED = ("RAY_ADDRESS",)


def require_ray() -> Any:
    """The `ray` module, or ValueError saying how to get it."""
    try:
        import ray
    except ImportError:
        raise ValueError("the ray backend needs Ray: pip install 'kvrelay[ray]'") from None
    return ray


def connect(address: str | None, log_to_driver: bool = True) -> Any:
    """Join the cluster (once per process); ConnectionError names the address tried.
    `log_to_driver=False`: the actors' output is not streamed to this process (`kvrelay
    deploy`, whose servers log to files: Ray's log monitor costs CPU beside them)."""
    ray = require_ray()
    if ray.is_initialized():
        return ray
    target = address or envs.RAY_ADDRESS.raw() or "auto"
    try:
        _check_reachable(target)             # ray.init retries a dead address for minutes
        ray.init(address=target, namespace=NAMESPACE, logging_level=logging.WARNING,
                 configure_logging=False, log_to_driver=log_to_driver)
    except (ConnectionError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConnectionError(
            f"cannot join a Ray cluster at {target!r}: {first}. kvrelay never starts one: run "
            "`ray start --head` (and `ray start --address HEAD:6379` on the other nodes), then "
            "set RAY_ADDRESS or --ray-address") from None
    if logger.isEnabledFor(logging.INFO):       # ray.nodes() is a call to the cluster
        logger.info("joined the Ray cluster at %s (%d nodes alive)", target,
                    sum(1 for n in ray.nodes() if n.get("Alive")))
    return ray


def _check_reachable(target: str) -> None:
    """A HOST:PORT address (not "auto", not a ray:// client URL) must accept a connection."""
    host, sep, port = target.rpartition(":")
    if not sep or "://" in target or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise ConnectionError(f"nothing answers at {host}:{port} ({e.strerror or e})") from None


def node_ip() -> str:
    """This node's address as the cluster knows it (where other nodes reach this process)."""
    ray = require_ray()
    return ray.util.get_node_ip_address()


def actor_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables an actor gets through its runtime_env."""
    environ = dict(os.environ) if environ is None else environ
    return {k: v for k, v in environ.items()
            if (k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES) and k not in _NOT_COPIED}


def place(bundles: list[dict[str, float]], strategy: str, what: str) -> Any:
    """A placement group of `bundles`, ready; RuntimeError naming what did not fit."""
    ray = require_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    pg = placement_group(bundles, strategy=strategy)
    timeout = envs.RAY_PLACEMENT_TIMEOUT_S.as_float() or 120.0
    if not pg.wait(timeout_seconds=timeout):
        remove_placement_group(pg)
        raise RuntimeError(
            f"Ray could not place {what}: {len(bundles)} bundle(s) of {bundles[0]} "
            f"({strategy}) within {timeout:.0f}s ({envs.RAY_PLACEMENT_TIMEOUT_S.shown}); the "
            f"cluster has {_compute(ray.available_resources())} available")
    return pg


def _compute(resources: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in resources.items() if k in ("CPU", "GPU")} or {"CPU": 0}


def in_bundle(pg: Any, index: int) -> Any:
    """The scheduling strategy that puts an actor in bundle `index` of `pg`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    return PlacementGroupSchedulingStrategy(placement_group=pg,
                                            placement_group_bundle_index=index)


def release(pg: Any, actors: list[Any]) -> None:
    """Kill the actors (no restart) and free their placement group; never raises."""
    ray = require_ray()
    from ray.util.placement_group import remove_placement_group
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception as e:              # already dead, or the cluster is gone
            logger.debug("ray.kill: %s", e)
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception as e:
            logger.debug("remove_placement_group: %s", e)


def cpus_per_worker() -> int:
    value = envs.RAY_CPUS_PER_WORKER.as_int() or 1
    if value < 1:
        raise ValueError(f"{envs.RAY_CPUS_PER_WORKER.shown} must be ≥ 1, got {value}")
    return value
