"""The daemon dies mid-job (`kill -9`): the orphan worker is killed, the job resumes."""

from __future__ import annotations

import os
import time

from tests.integration.service_daemon import Daemon, spec


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_kill_9_of_the_daemon_resumes_the_job_from_its_checkpoint(make_daemon) -> None:
    daemon: Daemon = make_daemon(FAKE_STEP_S="0.1")
    with daemon.client() as c:
        job = c.post("/v1/jobs", json=spec(train={"steps": 40, "checkpoint_interval": 5})).json()
    daemon.wait_for_step(job["id"], 12)
    log = (daemon.data_dir / "jobs" / job["id"] / "worker.log").read_text()
    worker_pid = int(log.rsplit("pid ", 1)[1].split()[0])
    daemon.kill()
    daemon.start()  # same data dir and port
    # The previous daemon's worker must not keep running next to the resumed one.
    deadline = time.monotonic() + 10
    while _alive(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker_pid)
    done = daemon.wait_for(job["id"], {"succeeded", "failed"}, timeout_s=60)
    assert done["status"] == "succeeded", done
    assert done["attempt"] == 2
    with daemon.client() as c:
        events = c.get(f"/v1/jobs/{job['id']}/events", params={"limit": 1000}).json()["data"]
    assert [e["id"] for e in events] == list(range(1, len(events) + 1))
    statuses = [e["data"]["status"] for e in events if e["type"] == "status"]
    assert statuses == ["queued", "running", "queued", "running", "succeeded"]
    requeue = [e for e in events if e["type"] == "status"][2]
    assert requeue["level"] == "warning" and "daemon restarted" in requeue["message"]
    steps = [e["data"]["step"] for e in events if e["type"] == "metrics"]
    restart_at = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    assert steps[restart_at] - 1 in (5, 10, 15, 20)  # resumed right after a checkpoint
    assert steps[-1] == 40


def test_restart_settles_pausing_and_cancelling(make_daemon) -> None:
    daemon: Daemon = make_daemon(FAKE_STEP_S="3", RP_MAX_CPU_JOBS="2")
    with daemon.client() as c:
        pausing = c.post("/v1/jobs", json=spec(train={"steps": 1000})).json()
        stubborn = c.post(
            "/v1/jobs", json=spec(name="ignore-sigterm", train={"steps": 1000})
        ).json()
        daemon.wait_for(pausing["id"], {"running"})
        daemon.wait_for(stubborn["id"], {"running"})
        assert c.post(f"/v1/jobs/{pausing['id']}/pause").json()["status"] == "pausing"
        assert c.post(f"/v1/jobs/{stubborn['id']}/cancel").json()["status"] == "cancelling"
    daemon.kill()
    daemon.start()
    with daemon.client() as c:
        assert c.get(f"/v1/jobs/{pausing['id']}").json()["status"] == "paused"
        assert c.get(f"/v1/jobs/{stubborn['id']}").json()["status"] == "cancelled"
        assert c.post(f"/v1/jobs/{pausing['id']}/resume").json()["status"] == "queued"
        again = daemon.wait_for(pausing["id"], {"running"}, timeout_s=30)
        assert again["attempt"] == 2
        c.post(f"/v1/jobs/{pausing['id']}/cancel")
        daemon.wait_for(pausing["id"], {"cancelled"}, timeout_s=20)


def test_cancel_escalates_to_sigkill(make_daemon) -> None:
    daemon: Daemon = make_daemon(RP_CANCEL_GRACE_S="1")
    with daemon.client() as c:
        job = c.post("/v1/jobs", json=spec(name="ignore-sigterm", train={"steps": 100000})).json()
        daemon.wait_for_step(job["id"], 1)
        c.post(f"/v1/jobs/{job['id']}/cancel")
        assert daemon.wait_for(job["id"], {"cancelled"}, timeout_s=10)["status"] == "cancelled"


def test_too_many_restarts_fail_the_job(make_daemon) -> None:
    daemon: Daemon = make_daemon(FAKE_STEP_S="0.1", RP_MAX_ATTEMPTS="1")
    with daemon.client() as c:
        job = c.post("/v1/jobs", json=spec(train={"steps": 1000})).json()
    daemon.wait_for_step(job["id"], 1)
    daemon.kill()
    daemon.start()
    daemon.wait_for_step(job["id"], 1)
    daemon.kill()
    daemon.start()
    done = daemon.wait_for(job["id"], {"failed"}, timeout_s=10)
    assert done["error"]["code"] == "too_many_restarts"
    assert os.path.isdir(daemon.data_dir / "jobs" / job["id"])


def test_a_graceful_stop_requeues_the_job_without_counting_a_restart(make_daemon) -> None:
    daemon: Daemon = make_daemon(FAKE_STEP_S="0.1", RP_MAX_ATTEMPTS="1")
    with daemon.client() as c:
        job = c.post("/v1/jobs", json=spec(train={"steps": 30, "checkpoint_interval": 5})).json()
    daemon.wait_for_step(job["id"], 7)
    daemon.stop()  # SIGTERM: uvicorn shuts down, the lifespan stops the worker
    daemon.start()
    done = daemon.wait_for(job["id"], {"succeeded", "failed"}, timeout_s=60)
    assert done["status"] == "succeeded" and done["attempt"] == 2, done
    with daemon.client() as c:
        events = c.get(f"/v1/jobs/{job['id']}/events", params={"limit": 1000}).json()["data"]
    requeue = [e for e in events if e["type"] == "status"][2]
    assert requeue["data"] == {"status": "queued", "previous": "running"}
    assert "daemon stopping" in requeue["message"]
