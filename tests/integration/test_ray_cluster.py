"""Jobs over two machines: a local Ray cluster of two simulated nodes (Ray's own
`cluster_utils.Cluster`, CPU, gloo) behind a real daemon with the real worker.

The oracle is the same job on one box (engine.nodes 1, the same global batch): the
2-node run trains the same losses and final weights (fp32, tight tolerance); an
interrupted 2-node run (a node removed mid-job, the job resumed from its checkpoint on
another node) ends with exactly the weights of the uninterrupted one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray.cluster_utils as ray_cluster_utils  # the ray extra (.ci/run installs it)
import torch

from tests.integration import job_runs
from tests.integration.job_runs import (
    TINY_FP32_CONFIG,
    assert_trained_alike,
    finish,
    losses,
    submit,
    weights,
)
from tests.integration.service_daemon import Daemon, spec

pytestmark = pytest.mark.timeout(300)

_NODE = {"num_cpus": 1, "object_store_memory": 80 << 20, "include_dashboard": False}


@pytest.fixture(scope="module")
def cluster_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Daemon]]:
    """Two simulated Ray nodes and a daemon that runs multi-node jobs on them."""
    cluster = ray_cluster_utils.Cluster(
        initialize_head=True, head_node_args={**_NODE, "include_dashboard": False}
    )
    cluster.add_node(num_cpus=1, object_store_memory=80 << 20)
    cluster.wait_for_nodes()
    root = tmp_path_factory.mktemp("ray-daemon")
    daemon = Daemon(
        root / "data",
        {
            "RP_WORKER_MODULE": "rp_service.worker",
            "RP_RAY_ADDRESS": cluster.address,
            "RP_SHARED_DIR": str(root / "shared"),
            "RP_MAX_CPU_JOBS": "2",
        },
    )
    daemon.start()
    with daemon.client() as c:  # the daemon connects to the cluster now, not mid-test
        assert len(c.get("/v1/system").json()["cluster"]["nodes"]) == 2
    try:
        yield cluster, daemon
    finally:
        daemon.stop()
        cluster.shutdown()


_STEPS = 40  # about 7 s of steps: room to remove a node mid-job


def _job(nodes: int, **train: Any) -> dict[str, Any]:
    return spec(
        model={"preset": "qwen3", "config": TINY_FP32_CONFIG, "dtype": "float32"},
        train={"steps": _STEPS, "batch_size": 4, "checkpoint_interval": 4, "seed": 3, **train},
        engine={"gpus": 0, "nodes": nodes, "num_microbatch": 2},
    )


def _gap_free(events: list[dict[str, Any]]) -> bool:
    ids = [int(e["id"]) for e in events]
    return ids == list(range(ids[0], ids[0] + len(ids)))


@pytest.fixture(scope="module")
def uninterrupted(cluster_daemon: tuple[Any, Daemon]) -> dict[str, Any]:
    """The 2-node job run through, and the same job on one box (run side by side)."""
    _, daemon = cluster_daemon
    two, one = submit(daemon, _job(2)), submit(daemon, _job(1))
    return {"two": finish(daemon, two), "one": finish(daemon, one)}


def test_two_nodes_train_as_one_box(
    cluster_daemon: tuple[Any, Daemon], uninterrupted: dict[str, Any]
) -> None:
    _, daemon = cluster_daemon
    two, one = uninterrupted["two"], uninterrupted["one"]
    assert sorted(losses(daemon, two["id"])) == list(range(1, _STEPS + 1))
    assert_trained_alike(daemon, two, one)
    events = job_runs.events(daemon, two["id"])
    assert _gap_free(events)
    assert any(e["message"].startswith("ranks on 2 nodes") for e in events)
    # every rank's optimizer shard is in the committed checkpoint
    last = sorted((Path(two["output_model_path"]).parent / "checkpoints").glob("step-*"))[-1]
    assert (last / "rank-00001.shard").is_file() and (last / "optimizer.safetensors").is_file()
    assert not list(last.parent.glob(".tmp-*"))


def test_a_node_lost_mid_job_resumes_on_another_then_pauses_and_resumes(
    cluster_daemon: tuple[Any, Daemon], uninterrupted: dict[str, Any]
) -> None:
    cluster, daemon = cluster_daemon
    job_id = submit(daemon, _job(2))
    daemon.wait_for_step(job_id, 4, timeout_s=120)  # its first checkpoint is committed
    with daemon.client() as c:
        cluster_info = c.get("/v1/system").json()["cluster"]
    assert cluster_info["address"] == cluster.address
    assert [n["jobs"] for n in cluster_info["nodes"]] == [[job_id], [job_id]]
    cluster.remove_node(next(iter(cluster.worker_nodes)))
    with daemon.client() as c:
        assert c.get(f"/v1/jobs/{job_id}").json()["status"] in ("running", "queued")  # mid-job
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the retry waits for a second node
        if any("waiting for 2 nodes" in e["message"] for e in job_runs.events(daemon, job_id)):
            break
        time.sleep(0.2)
    else:
        raise AssertionError(job_runs.events(daemon, job_id))
    cluster.add_node(**{k: v for k, v in _NODE.items() if k != "include_dashboard"})
    # then a pause and a resume on the new node set: every rank stops after the same step
    with daemon.client() as c:  # the step attempt 1 reached: attempt 2 trains past it
        reached = c.get(f"/v1/jobs/{job_id}").json()["progress"]["step"]
    daemon.wait_for_step(job_id, reached + 2, timeout_s=120)
    with daemon.client() as c:
        assert c.post(f"/v1/jobs/{job_id}/pause").status_code == 200
    paused = daemon.wait_for(job_id, {"paused", "failed", "succeeded"}, timeout_s=120)
    assert paused["status"] == "paused" and paused["progress"]["step"] < _STEPS
    with daemon.client() as c:
        assert c.post(f"/v1/jobs/{job_id}/resume").status_code == 200
    done = finish(daemon, job_id)
    assert done["attempt"] == 3 and done["restarts"] == 1
    events = job_runs.events(daemon, job_id)
    assert _gap_free(events)
    lost = [e for e in events if e["level"] == "warning" and "left the Ray cluster" in e["message"]]
    assert len(lost) == 1, [e["message"] for e in events]
    assert sum(e["message"].startswith("ranks on 2 nodes") for e in events) == 3
    expected = weights(uninterrupted["two"])
    got = weights(done)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name  # resumed bit for bit


def test_bad_requests_name_the_field(cluster_daemon: tuple[Any, Daemon]) -> None:
    _, daemon = cluster_daemon
    cases = [
        (_job(3, batch_size=6), "engine.nodes"),  # the cluster has 2
        (_job(2, batch_size=3), "train.batch_size"),
        (_job(2, method="lora"), "train.method"),
    ]
    with daemon.client() as c:
        for body, param in cases:
            r = c.post("/v1/jobs", json=body)
            assert r.status_code == 422, r.text
            assert r.json()["error"]["param"] == param, r.text
