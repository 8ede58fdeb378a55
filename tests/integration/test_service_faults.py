"""Worker deaths that are not the job's fault are retried; one metric value per step."""

from __future__ import annotations

import time
from typing import Any

from tests.integration.service_daemon import Daemon, spec


def _events(daemon: Daemon, job_id: str) -> list[dict[str, Any]]:
    with daemon.client() as c:
        return c.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]


def test_a_sigkilled_worker_resumes_from_its_checkpoint_and_replays_are_announced(
    make_daemon,
) -> None:
    daemon: Daemon = make_daemon()
    with daemon.client() as c:
        job = c.post(
            "/v1/jobs",
            json=spec(name="sigkill-once", train={"steps": 12, "checkpoint_interval": 5}),
        ).json()
    done = daemon.wait_for(job["id"], {"succeeded", "failed"})
    assert done["status"] == "succeeded", done
    assert done["attempt"] == 2 and done["restarts"] == 1
    events = _events(daemon, job["id"])
    assert [e["id"] for e in events] == list(range(1, len(events) + 1))
    statuses = [e for e in events if e["type"] == "status"]
    assert [e["data"]["status"] for e in statuses] == [
        "queued",
        "running",
        "queued",
        "running",
        "succeeded",
    ]
    retry = statuses[2]
    assert retry["level"] == "warning"
    assert retry["message"].startswith("worker killed by signal 9 (SIGKILL): job re-queued")
    assert "retry 1 of 3" in retry["message"]
    assert retry["data"]["retry"] == 1 and retry["data"]["rss_bytes"] > 0
    # Attempt 1 reached step 8 after the checkpoint at 5: steps 6-8 are trained again.
    metrics = [(e["data"]["step"], e["data"]["attempt"]) for e in events if e["type"] == "metrics"]
    assert metrics == [(s, 1) for s in range(1, 9)] + [(s, 2) for s in range(6, 13)]
    (replay,) = [e for e in events if "replayed_steps" in e["data"]]
    assert replay["message"].startswith("steps 6-8 replayed after resume from step 5")
    assert replay["data"] == {"replayed_steps": [6, 8], "resumed_from": 5, "attempt": 2}
    first_replayed = next(e for e in events if e["type"] == "metrics" and e["data"]["attempt"] == 2)
    assert replay["id"] == first_replayed["id"] - 1
    with daemon.client() as c:
        series = c.get(f"/v1/jobs/{job['id']}/metrics").json()["columns"]
    assert series["step"] == list(range(1, 13))
    assert series["attempt"] == [1] * 5 + [2] * 7
    assert series["train_loss"] == [10.0 / s for s in range(1, 13)]


def test_a_worker_that_keeps_dying_fails_after_rp_max_attempts(make_daemon) -> None:
    daemon: Daemon = make_daemon(RP_MAX_ATTEMPTS="2")
    with daemon.client() as c:
        job = c.post(
            "/v1/jobs", json=spec(name="sigkill-always", train={"checkpoint_interval": 2})
        ).json()
    done = daemon.wait_for(job["id"], {"succeeded", "failed"})
    assert done["status"] == "failed"
    assert done["attempt"] == 3 and done["restarts"] == 2
    assert done["error"]["code"] == "worker_failed"
    assert done["error"]["message"] == (
        "worker killed by signal 9 (SIGKILL) (after 2 retries, RP_MAX_ATTEMPTS=2)"
    )
    retries = [e for e in _events(daemon, job["id"]) if "retry" in e["data"]]
    assert [e["data"]["retry"] for e in retries] == [1, 2]


def test_a_device_fault_is_retried_and_the_job_succeeds(make_daemon) -> None:
    daemon: Daemon = make_daemon()
    with daemon.client() as c:
        job = c.post("/v1/jobs", json=spec(name="device-fault-once", train={"steps": 4})).json()
    done = daemon.wait_for(job["id"], {"succeeded", "failed"})
    assert done["status"] == "succeeded" and done["attempt"] == 2, done
    retry = next(e for e in _events(daemon, job["id"]) if "retry" in e["data"])
    assert retry["message"].startswith("device fault: RuntimeError: CUDA error")


def test_a_full_disk_pauses_the_job_keeps_its_checkpoints_and_the_daemon_serves(
    make_daemon,
) -> None:
    """The fake worker meets ENOSPC at its second checkpoint, each attempt: the job is
    paused waiting_for_disk (it used to fail disk_full), its checkpoint kept, and the disk
    watch re-queues it by itself since the disk has room (a retry reaches it again)."""
    daemon: Daemon = make_daemon()
    with daemon.client() as c:
        job = c.post("/v1/jobs", json=spec(name="disk-full", train={"steps": 20})).json()
        done = daemon.wait_for(job["id"], {"paused", "succeeded", "failed"})
        assert done["status"] == "paused" and done["attempt"] == 1, done
        error = done["error"]
        assert error["code"] == "waiting_for_disk"
        assert "disk full while writing" in error["message"]
        assert "earlier checkpoints are intact" in error["message"]
        assert error["details"]["total_bytes"] >= error["details"]["free_bytes"] >= 0
        kept = c.get(f"/v1/jobs/{job['id']}/checkpoints").json()["data"]
        assert [k["step"] for k in kept] == [5]
        tar = c.get(f"/v1/jobs/{job['id']}/checkpoints/5/content")
        assert tar.status_code == 200
        assert c.get("/healthz").status_code == 200
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            messages = [e["message"] for e in _events(daemon, job["id"])]
            if any(m.startswith("disk space is back") for m in messages):
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"not re-queued after the disk had room: {messages}")
        assert c.post(f"/v1/jobs/{job['id']}/cancel").status_code == 200
        nxt = c.post("/v1/jobs", json=spec(train={"steps": 3})).json()
        assert daemon.wait_for(nxt["id"], {"succeeded"})["status"] == "succeeded"
