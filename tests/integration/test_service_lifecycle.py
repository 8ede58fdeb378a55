"""Submit, run, cancel, pause/resume, worker crashes: against a real daemon + fake worker."""

from __future__ import annotations

import io
import json
import os
import signal
import tarfile
import time

from tests.integration.service_daemon import Daemon, spec


def _events(daemon: Daemon, job_id: str) -> list[dict]:
    with daemon.client() as c:
        return c.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]


def _statuses(events: list[dict]) -> list[str]:
    return [e["data"]["status"] for e in events if e["type"] == "status"]


def test_submit_runs_to_success_with_events_in_order(make_daemon) -> None:
    # Every checkpoint kept after the end (the default keeps the last one; see
    # test_service_security.py), so all three can be listed and one downloaded.
    service_daemon: Daemon = make_daemon(RP_KEEP_FINISHED_CHECKPOINTS="100")
    with service_daemon.client() as c:
        r = c.post("/v1/jobs", json=spec())
        assert r.status_code == 201, r.text
        job = r.json()
        assert job["status"] == "queued"
    done = service_daemon.wait_for(job["id"], {"succeeded", "failed"})
    assert done["status"] == "succeeded", done
    assert done["output_model_path"].endswith("output")
    assert done["progress"]["step"] == 20
    assert done["trained_tokens"] == 20 * 64
    assert done["attempt"] == 1
    assert done["finished_at"] >= done["started_at"] >= done["created_at"]
    events = _events(service_daemon, job["id"])
    assert [e["id"] for e in events] == list(range(1, len(events) + 1))
    assert _statuses(events) == ["queued", "running", "succeeded"]
    assert events[-1]["data"] == {"status": "succeeded", "previous": "running"}
    steps = [e["data"]["step"] for e in events if e["type"] == "metrics"]
    assert steps == list(range(1, 21))
    with service_daemon.client() as c:
        ckpts = c.get(f"/v1/jobs/{job['id']}/checkpoints").json()["data"]
        assert [k["step"] for k in ckpts] == [5, 10, 15]
        series = c.get(f"/v1/jobs/{job['id']}/metrics").json()["columns"]
        assert series["step"] == list(range(1, 21))
        log = c.get(f"/v1/jobs/{job['id']}/logs")
        assert b"fake worker attempt 1" in log.content
        assert int(log.headers["x-next-offset"]) == len(log.content)
        tar = c.get(f"/v1/jobs/{job['id']}/checkpoints/10/content")
        assert tar.status_code == 200
        assert tar.headers["content-type"] == "application/x-tar"
        with tarfile.open(fileobj=io.BytesIO(tar.content)) as archive:
            names = archive.getnames()
            state = archive.extractfile("step-10/state.json").read()
        assert sorted(names) == ["step-10", "step-10/state.json", "step-10/weights.bin"]
        assert json.loads(state) == {"step": 10}


def test_cancel_stops_the_worker_and_frees_the_slot(service_daemon: Daemon) -> None:
    with service_daemon.client() as c:
        job = c.post("/v1/jobs", json=spec(train={"steps": 100000})).json()
        service_daemon.wait_for_step(job["id"], 2)
        r = c.post(f"/v1/jobs/{job['id']}/cancel")
        assert r.status_code == 200
        assert r.json()["status"] in ("cancelling", "cancelled")
        started = time.monotonic()
        done = service_daemon.wait_for(job["id"], {"cancelled"}, timeout_s=15)
        assert time.monotonic() - started < 10
        assert done["finished_at"] is not None
        # The CPU slot is free again: the next job runs.
        nxt = c.post("/v1/jobs", json=spec(train={"steps": 3})).json()
        assert service_daemon.wait_for(nxt["id"], {"succeeded"})["status"] == "succeeded"
        # A finished job cannot be cancelled.
        r = c.post(f"/v1/jobs/{job['id']}/cancel")
        assert r.status_code == 409
        assert r.headers["x-should-retry"] == "false"
        assert r.json()["error"]["type"] == "conflict_error"


def test_pause_then_resume_continues_from_the_checkpoint(service_daemon: Daemon) -> None:
    with service_daemon.client() as c:
        job = c.post("/v1/jobs", json=spec(train={"steps": 60, "checkpoint_interval": 0})).json()
        service_daemon.wait_for_step(job["id"], 3)
        r = c.post(f"/v1/jobs/{job['id']}/pause")
        assert r.json()["status"] in ("pausing", "paused")
        paused = service_daemon.wait_for(job["id"], {"paused"}, timeout_s=15)
        assert paused["gpus"] == []
        ckpts = c.get(f"/v1/jobs/{job['id']}/checkpoints").json()["data"]
        assert len(ckpts) == 1
        paused_step = ckpts[0]["step"]
        assert c.post(f"/v1/jobs/{job['id']}/resume").json()["status"] == "queued"
        done = service_daemon.wait_for(job["id"], {"succeeded", "failed"})
        assert done["status"] == "succeeded"
        assert done["attempt"] == 2
    events = _events(service_daemon, job["id"])
    assert _statuses(events) == [
        "queued",
        "running",
        "pausing",
        "paused",
        "queued",
        "running",
        "succeeded",
    ]
    steps = [e["data"]["step"] for e in events if e["type"] == "metrics"]
    resumed = steps.index(paused_step) + 1
    assert steps[resumed] == paused_step + 1  # nothing redone, nothing skipped
    assert steps[-1] == 60


def test_resume_of_a_running_job_is_a_conflict(service_daemon: Daemon) -> None:
    with service_daemon.client() as c:
        job = c.post("/v1/jobs", json=spec(train={"steps": 100000})).json()
        service_daemon.wait_for(job["id"], {"running"})
        r = c.post(f"/v1/jobs/{job['id']}/resume")
        assert r.status_code == 409
        assert r.headers["x-should-retry"] == "false"
        assert "only a paused job" in r.json()["error"]["message"]
        c.post(f"/v1/jobs/{job['id']}/cancel")
        service_daemon.wait_for(job["id"], {"cancelled"})


def test_kill_9_of_a_worker_is_retried_then_fails_the_job_and_the_daemon_keeps_serving(
    make_daemon,
) -> None:
    daemon: Daemon = make_daemon(RP_MAX_ATTEMPTS="1")
    with daemon.client() as c:
        job = c.post("/v1/jobs", json=spec(train={"steps": 100000})).json()
        daemon.wait_for_step(job["id"], 2)
        first = _worker_pid(daemon, job["id"])
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _worker_pid(daemon, job["id"]) == first and time.monotonic() < deadline:
            time.sleep(0.05)
        again = c.get(f"/v1/jobs/{job['id']}").json()
        assert again["attempt"] == 2 and again["status"] == "running", again
        os.kill(_worker_pid(daemon, job["id"]), signal.SIGKILL)
        done = daemon.wait_for(job["id"], {"failed"}, timeout_s=15)
        assert done["error"]["code"] == "worker_failed"
        assert "worker killed by signal 9" in done["error"]["message"]
        assert "after 1 retries, RP_MAX_ATTEMPTS=1" in done["error"]["message"]
        assert c.get("/healthz").status_code == 200
        nxt = c.post("/v1/jobs", json=spec(train={"steps": 3})).json()
        assert daemon.wait_for(nxt["id"], {"succeeded"})["status"] == "succeeded"


def test_worker_bad_input_error_becomes_the_job_error(service_daemon: Daemon) -> None:
    with service_daemon.client() as c:
        job = c.post("/v1/jobs", json=spec(name="fail-input")).json()
    done = service_daemon.wait_for(job["id"], {"failed", "succeeded"})
    assert done["status"] == "failed"
    assert done["error"] == {
        "code": "invalid_data",  # the worker's own code
        "message": "data.train: line 3 is not valid JSON",
        "param": "data.train",
        "details": None,
    }
    assert done["attempt"] == 1 and done["restarts"] == 0  # the job's own error: no retry


def _worker_pid(daemon: Daemon, job_id: str) -> int:
    """The fake worker prints its pid on stderr, which the daemon appends to worker.log."""
    log = (daemon.data_dir / "jobs" / job_id / "worker.log").read_text()
    return int(log.rsplit("pid ", 1)[1].split()[0])


def test_logs_follow_streams_until_the_job_ends(service_daemon: Daemon) -> None:
    with service_daemon.client() as c:
        job = c.post("/v1/jobs", json=spec(train={"steps": 10})).json()
        with c.stream("GET", f"/v1/jobs/{job['id']}/logs", params={"follow": "true"}) as r:
            assert r.status_code == 200
            body = b"".join(r.iter_bytes())  # returns only once the job is over
        assert c.get(f"/v1/jobs/{job['id']}").json()["status"] == "succeeded"
        assert b"fake worker attempt 1" in body
        tail = c.get(f"/v1/jobs/{job['id']}/logs", params={"offset": 5})
        assert tail.content == body[5:]


def test_a_worker_that_cannot_start_fails_the_job_with_its_log(make_daemon) -> None:
    daemon: Daemon = make_daemon(RP_WORKER_MODULE="no_such_worker_module")
    with daemon.client() as c:
        job = c.post("/v1/jobs", json=spec()).json()
        done = daemon.wait_for(job["id"], {"failed", "succeeded"})
        assert done["error"]["code"] == "worker_failed"
        assert done["error"]["message"].startswith("worker exited with status 1")
        assert (
            b"No module named no_such_worker_module" in c.get(f"/v1/jobs/{job['id']}/logs").content
        )
