"""`python -m rp_service.cluster.driver JOB_DIR`: one attempt of a job over several nodes.

The orchestrator starts this in place of the worker when `engine.nodes` > 1 and reads it
as it reads a worker: its stdout is the event pipe, its exit status the outcome, SIGTERM
cancels and SIGUSR1 pauses. Here:

1. connect to the Ray cluster (`resolved.ray_address` of spec.json) and reserve the job's
   resources: a placement group of `engine.nodes` bundles of one CPU and `engine.gpus`
   GPUs, STRICT_SPREAD (one bundle a node), named after the job; wait for it;
2. copy the datasets into the job's folder when they are not on the shared folder yet;
3. start one `RankAgent` actor in each bundle; check that every node has the model folder,
   the tokenizer folder and the job's folder (the shared mount);
4. start the ranks (torch.distributed's env rendezvous: rank 0's node and a free port as
   MASTER_ADDR / MASTER_PORT); pass rank 0's event lines on to stdout and every rank's
   log lines on to stderr (the job's worker.log), and signals to every rank;
5. exit with rank 0's status. A node that leaves the cluster (its raylet gone: the actor
   dies) fails the attempt with the retryable `node_lost` error; the others are killed.

Actors and placement group belong to this process: Ray removes them if it dies.
Plain actors rather than Ray Train's TorchTrainer: the rank must stay the worker's own
process (its signal protocol, exit statuses, stdout pipe), which an actor runs as is, and
the daemon is already the trainer's controller (retries, checkpoints, events).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from rp_service.cluster.agent import RankAgent
from rp_service.cluster.follow import RankLost, Signals, follow_ranks, start_launcher
from rp_service.cluster.nodes import NAMESPACE, placement_group_name
from rp_service.durable import write_bytes
from rp_service.worker.main import EXIT_CANCELLED, EXIT_FAILED, EXIT_PAUSED, EventWriter

__all__ = ["main"]

log = logging.getLogger("rp_service.cluster.driver")

_POLL_S = 0.1
_WAITING_NOTE_S = 5.0  # a placement group not ready after this long: say what it waits for
_INPUTS_DIR = "inputs"


def _stage_inputs(job_dir: Path, payload: dict[str, Any], shared: Path) -> bool:
    """Copy the datasets that are not under the shared folder into the job's folder and
    point `resolved` at the copies; returns whether anything changed."""
    resolved = payload["resolved"]
    changed = False
    for key in ("train_path", "valid_path"):
        source = resolved.get(key)
        if not source or source == "synthetic" or Path(source).is_relative_to(shared):
            continue
        target = job_dir / _INPUTS_DIR / f"{key.removesuffix('_path')}{Path(source).suffix}"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        resolved[key] = str(target)
        changed = True
    return changed


def _needed_paths(job_dir: Path, resolved: dict[str, Any]) -> dict[str, str]:
    """Field -> path, for what every node must have."""
    paths = {"RP_SHARED_DIR": str(job_dir)}
    for field, key in (("model.path", "model_path"), ("tokenizer.path", "tokenizer_path")):
        if resolved.get(key):
            paths[field] = str(resolved[key])
    return paths


class _RayRank:
    """A rank's `RankAgent` actor, read as `follow_ranks` reads any rank."""

    def __init__(self, agent: Any, rank: int) -> None:
        self.agent = agent
        self.rank = rank

    def take(self) -> tuple[list[str], list[str], int | None]:
        import ray
        from ray.exceptions import RayActorError

        try:
            out, err, code = ray.get(self.agent.take.remote())
        except RayActorError as exc:
            raise RankLost(
                f"the node of rank {self.rank} left the Ray cluster mid-job "
                f"({type(exc).__name__}); the attempt ends here"
            ) from exc
        return out, err, code

    def signal(self, signum: int) -> None:
        self.agent.signal.remote(int(signum))

    def kill(self) -> None:
        import ray

        try:
            ray.get(self.agent.kill.remote(), timeout=5.0)
        except Exception:  # a dead node's actor: nothing left to kill there
            pass
        ray.kill(self.agent)


class _Driver:
    def __init__(self, job_dir: Path, emit: EventWriter, signals: Signals) -> None:
        self.job_dir = job_dir
        self.emit = emit
        self.signals = signals
        self.payload = json.loads((job_dir / "spec.json").read_text())
        engine = self.payload["spec"]["engine"]
        self.nodes, self.gpus = int(engine["nodes"]), int(engine.get("gpus", 0))
        self.agents: list[Any] = []
        self.pg: Any = None

    def fail(self, code: str, message: str, param: str | None = None) -> int:
        data = {"code": code, "message": message, "param": param}
        self.emit("message", message, data, level="error")
        return EXIT_FAILED

    def run(self) -> int:
        import ray

        resolved = self.payload["resolved"]
        try:
            ray.init(
                address=resolved["ray_address"],
                namespace=NAMESPACE,
                logging_level=logging.WARNING,
                log_to_driver=False,
            )
        except Exception as exc:  # retried as a lost node is: the cluster may come back
            return self.fail(
                "cluster_unreachable",
                f"the Ray cluster at {resolved['ray_address']} cannot be reached: {exc}",
            )
        code = self._reserve()
        if code is not None:
            return code
        if _stage_inputs(self.job_dir, self.payload, Path(resolved["shared_dir"])):
            write_bytes(self.job_dir / "spec.json", json.dumps(self.payload, indent=2).encode())
        strategy = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy
        actor = ray.remote(RankAgent)
        self.agents = [
            actor.options(
                num_cpus=1,
                num_gpus=self.gpus,
                scheduling_strategy=strategy(
                    placement_group=self.pg, placement_group_bundle_index=i
                ),
            ).remote()
            for i in range(self.nodes)
        ]
        infos = ray.get([a.node.remote() for a in self.agents])
        needed = _needed_paths(self.job_dir, resolved)
        for rank, missing in enumerate(ray.get([a.missing.remote(needed) for a in self.agents])):
            for field, path in missing.items():
                where = f"node {infos[rank]['address']} (Ray node {infos[rank]['node_id'][:12]})"
                if field == "RP_SHARED_DIR":
                    return self.fail(
                        "shared_dir_missing",
                        f"{where} does not see the job's folder {path}: mount RP_SHARED_DIR "
                        "at the same path on every node",
                    )
                return self.fail(
                    "path_not_on_node",
                    f"{field}: {where} has no folder {path}; put it under RP_SHARED_DIR or "
                    "copy it to the same path on every node",
                    field,
                )
        self.emit(
            "message",
            f"ranks on {self.nodes} nodes: "
            + ", ".join(f"{r}: {i['address']}" for r, i in enumerate(infos)),
            {"nodes": [{"rank": r, **i} for r, i in enumerate(infos)]},
        )
        base = {
            "MASTER_ADDR": infos[0]["address"],
            "MASTER_PORT": str(infos[0]["port"]),
            "WORLD_SIZE": str(self.nodes),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "PYTHONUNBUFFERED": "1",
            # The daemon set both for this process (rp_service.jobs.pipe); the ranks get
            # them as a local worker would.
            "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
            "RP_DEVICES": "cuda" if self.gpus > 0 else os.environ.get("RP_DEVICES", "cpu:1"),
        }
        ray.get(
            [
                a.start.remote(str(self.job_dir), {**base, "RANK": str(r), "GROUP_RANK": str(r)})
                for r, a in enumerate(self.agents)
            ]
        )
        handles = [_RayRank(agent, rank) for rank, agent in enumerate(self.agents)]
        return follow_ranks(handles, self.emit, self.signals, self.fail)

    def _reserve(self) -> int | None:
        """Wait for the placement group; an exit status when cancelled or paused first."""
        from ray.util.placement_group import placement_group

        bundle = {"CPU": 1.0, **({"GPU": float(self.gpus)} if self.gpus else {})}
        self.pg = placement_group(
            [dict(bundle) for _ in range(self.nodes)],
            strategy="STRICT_SPREAD",
            name=placement_group_name(self.payload["job_id"]),
        )
        ready = self.pg.ready()
        started = time.monotonic()
        noted = False
        import ray

        while True:
            done, _ = ray.wait([ready], timeout=_POLL_S)
            if done:
                return None
            if self.signals.cancel:
                return EXIT_CANCELLED
            if self.signals.pause:
                self.emit("status", "paused before starting", {"status": "paused", "step": None})
                return EXIT_PAUSED
            if not noted and time.monotonic() - started > _WAITING_NOTE_S:
                noted = True
                self.emit(
                    "message",
                    f"waiting for {self.nodes} nodes with 1 CPU and {self.gpus} GPU(s) free "
                    "each in the Ray cluster",
                    {"reason": "waiting_for_nodes", "nodes": self.nodes, "gpus": self.gpus},
                    level="warning",
                )

    def close(self) -> None:
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.pg)
            except Exception as exc:
                log.warning("removing the placement group failed: %s", exc)


def main(argv: list[str] | None = None) -> int:
    """Entry point: `python -m rp_service.cluster.driver JOB_DIR`."""
    started = start_launcher(argv, "rp_service.cluster.driver")
    if started is None:
        return 2
    job_dir, emit, signals = started
    driver = _Driver(job_dir, emit, signals)
    try:
        return driver.run()
    except Exception as exc:
        log.exception("the driver failed")
        return driver.fail("cluster_error", f"the Ray driver failed: {type(exc).__name__}: {exc}")
    finally:
        driver.close()


if __name__ == "__main__":
    sys.exit(main())
