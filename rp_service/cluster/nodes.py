"""The daemon's view of its Ray cluster: nodes, their resources, the jobs holding them.

The daemon connects to the cluster (`ray.init(address=RP_RAY_ADDRESS)`) the first time it
needs it: a submission with `engine.nodes` > 1, or GET /v1/system. Blocking; call it from a
thread. A job's resources are the placement group named `placement_group_name(job_id)`
(made by rp_service.cluster.driver), so the nodes a job holds are read back from Ray.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from rp_service.errors import InvalidRequest, NotReady
from rp_service.schemas import JobSpec
from rp_service.settings import Settings

__all__ = [
    "NAMESPACE",
    "ClusterView",
    "check_nodes_request",
    "data_parallel_refusal",
    "placement_group_name",
]

log = logging.getLogger(__name__)

NAMESPACE = "roundpipe"  # the daemon's and its drivers' Ray namespace
_PG_PREFIX = "rp-"


def placement_group_name(job_id: str) -> str:
    return f"{_PG_PREFIX}{job_id}"


def data_parallel_refusal(spec: JobSpec) -> tuple[str, str, str] | None:
    """(field, its value, the value data-parallel ranks need) for a job they cannot run
    yet: DPO's reference pass and LoRA's adapter save under sharded masters
    (docs/SCALING.md); None when they can. Ranks over nodes and over one box's GPUs."""
    for param, value, allowed in (
        ("train.objective", spec.train.objective, "sft"),
        ("train.method", spec.train.method, "full"),
    ):
        if value != allowed:
            return param, value, allowed
    return None


def check_nodes_request(spec: JobSpec, settings: Settings) -> None:
    """What `engine.nodes` > 1 needs from the daemon's settings and the spec itself
    (no cluster call): InvalidRequest naming the field otherwise."""
    nodes = spec.engine.nodes
    if nodes <= 1:
        return
    if settings.ray_address is None:
        raise InvalidRequest(
            f"engine.nodes: {nodes} asks for several machines, but this daemon has no Ray "
            "cluster (RP_RAY_ADDRESS is unset); set engine.nodes to 1, or start the daemon "
            "with RP_RAY_ADDRESS and RP_SHARED_DIR (docs/SCALING.md)",
            code="no_cluster",
            param="engine.nodes",
        )
    if settings.shared_dir is None:
        raise InvalidRequest(
            f"engine.nodes: {nodes} needs a folder every node mounts, for the job's data and "
            "checkpoints, but RP_SHARED_DIR is unset; set it on the daemon (docs/SCALING.md)",
            code="no_shared_dir",
            param="engine.nodes",
        )
    refused = data_parallel_refusal(spec)
    if refused is not None:
        param, value, allowed = refused
        raise InvalidRequest(
            f"{param}: {value!r} jobs run on one box only; use engine.nodes 1 or "
            f"{param} {allowed!r}",
            code="not_on_nodes",
            param=param,
        )
    if spec.train.batch_size % nodes:
        raise InvalidRequest(
            f"train.batch_size: {spec.train.batch_size} sequences do not split equally over "
            f"engine.nodes={nodes} ranks; use a multiple of {nodes}",
            code="batch_not_divisible",
            param="train.batch_size",
        )


class ClusterView:
    """The cluster behind RP_RAY_ADDRESS, connected to on first use (blocking calls)."""

    def __init__(self, settings: Settings) -> None:
        if settings.ray_address is None:
            raise ValueError("ClusterView needs RP_RAY_ADDRESS")
        self.address = settings.ray_address
        self._lock = threading.Lock()

    def _ray(self) -> Any:
        import ray  # only here: a one-box daemon never loads it

        with self._lock:
            if not ray.is_initialized():
                ray.init(
                    address=self.address,
                    namespace=NAMESPACE,
                    logging_level=logging.WARNING,
                    log_to_driver=False,
                    configure_logging=False,
                )
        return ray

    def nodes(self) -> list[dict[str, Any]]:
        """The cluster's live nodes: id, address, CPUs, GPUs, host memory, jobs holding them."""
        ray = self._ray()
        from ray.util import placement_group_table

        holders: dict[str, list[str]] = {}
        for table in placement_group_table().values():
            name = table.get("name") or ""
            if not name.startswith(_PG_PREFIX) or table.get("state") == "REMOVED":
                continue
            for node_id in set((table.get("bundles_to_node_id") or {}).values()):
                holders.setdefault(node_id, []).append(name[len(_PG_PREFIX) :])
        rows = []
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            resources = node.get("Resources") or {}
            rows.append(
                {
                    "node_id": node["NodeID"],
                    "address": node.get("NodeManagerAddress"),
                    "cpus": int(resources.get("CPU", 0)),
                    "gpus": int(resources.get("GPU", 0)),
                    "memory_bytes": int(resources.get("memory", 0)),
                    "jobs": sorted(holders.get(node["NodeID"], [])),
                }
            )
        return sorted(rows, key=lambda r: r["node_id"])

    def check(self, spec: JobSpec) -> None:
        """InvalidRequest (422, naming engine.nodes or engine.gpus) when the cluster has
        fewer nodes than the job asks for. The cluster is taken as it is now: a cluster
        that grows (an autoscaler) is not waited for."""
        nodes, gpus = spec.engine.nodes, spec.engine.gpus
        try:
            live = self.nodes()
        except Exception as exc:  # ray's own errors: the cluster is down or unreachable
            raise NotReady(
                f"the Ray cluster at {self.address} (RP_RAY_ADDRESS) cannot be reached: "
                f"{type(exc).__name__}: {exc}; try again once it is up",
                code="cluster_unreachable",
            ) from exc
        fitting = [n for n in live if n["cpus"] >= 1 and n["gpus"] >= gpus]
        if len(fitting) >= nodes:
            return
        param = "engine.nodes" if len(live) < nodes else "engine.gpus"
        per_node = f" with {gpus} GPU(s) each" if gpus else ""
        raise InvalidRequest(
            f"{param}: the job asks for {nodes} nodes{per_node}, but the Ray cluster at "
            f"{self.address} has {len(fitting)} such node(s) of {len(live)}; lower "
            f"engine.nodes or engine.gpus, or add machines (ray start --address)",
            code="not_enough_nodes",
            param=param,
        )
