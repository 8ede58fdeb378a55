"""The HTTP contract against a real daemon: auth, idempotency, uploads, bad input, limits."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from tests.integration.service_daemon import Daemon, spec

TOKEN = "s3cret-token"


def test_every_route_but_healthz_needs_the_token(make_daemon) -> None:
    daemon: Daemon = make_daemon(RP_TOKEN=TOKEN)
    with daemon.client() as c:
        schema = c.get("/openapi.json").json()
    routes = [
        (
            method.upper(),
            path.replace("{job_id}", "job-x").replace("{file_id}", "file-x").replace("{step}", "1"),
        )
        for path, item in schema["paths"].items()
        for method in item
    ]
    routes += [("GET", "/openapi.json"), ("GET", "/nope")]
    assert ("GET", "/healthz") in routes and ("GET", "/metrics") in routes
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        with httpx.Client(base_url=daemon.base_url, headers=headers, timeout=30) as anon:
            for method, path in routes:
                r = anon.request(method, path)
                if path == "/healthz":
                    assert r.status_code == 200
                    continue
                assert r.status_code == 401, (method, path, r.status_code)
                assert r.json()["error"]["type"] == "authentication_error"
                assert r.headers["www-authenticate"] == "Bearer"
        # /docs only points a browser at the dashboard's API view (which asks for the token)
        with httpx.Client(base_url=daemon.base_url, headers=headers, timeout=30) as anon:
            r = anon.get("/docs")
            assert (r.status_code, r.headers["location"]) == (307, "/#/api")
    with daemon.client() as c:
        assert c.get("/v1/jobs").status_code == 200


def test_concurrent_submissions_with_one_idempotency_key_create_one_job(
    service_daemon: Daemon,
) -> None:
    body = spec(train={"steps": 3})
    results: list[httpx.Response] = []

    def submit() -> None:
        with service_daemon.client() as c:
            results.append(c.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k-1"}))

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in results)
    assert codes == [200] * 7 + [201]
    assert len({r.json()["id"] for r in results}) == 1
    with service_daemon.client() as c:
        assert len(c.get("/v1/jobs").json()["data"]) == 1
        other = c.post(
            "/v1/jobs", json=spec(train={"steps": 4}), headers={"Idempotency-Key": "k-1"}
        )
        assert other.status_code == 409
        assert other.headers["x-should-retry"] == "false"
        assert other.json()["error"]["param"] == "Idempotency-Key"


def test_jobs_list_pages_newest_first(service_daemon: Daemon) -> None:
    with service_daemon.client() as c:
        ids = [c.post("/v1/jobs", json=spec(train={"steps": 1000})).json()["id"] for _ in range(3)]
        page = c.get("/v1/jobs", params={"limit": 2}).json()
        assert [j["id"] for j in page["data"]] == ids[::-1][:2]
        assert page["has_more"] is True and page["last_id"] == ids[1]
        rest = c.get("/v1/jobs", params={"limit": 2, "after": page["last_id"]}).json()
        assert [j["id"] for j in rest["data"]] == [ids[0]] and rest["has_more"] is False
        queued = c.get("/v1/jobs", params={"status": "queued"}).json()["data"]
        assert {j["id"] for j in queued} == set(ids[1:])
        for job_id in ids:
            c.post(f"/v1/jobs/{job_id}/cancel")


def test_upload_and_train_on_a_file(service_daemon: Daemon) -> None:
    lines = b"".join(json.dumps({"text": f"line {i}"}).encode() + b"\n" for i in range(17))
    with service_daemon.client() as c:
        r = c.post("/v1/files", files={"file": ("d.jsonl", lines)})
        assert r.status_code == 201, r.text
        f = r.json()
        assert f["line_count"] == 17 and f["format"] == "text" and f["bytes"] == len(lines)
        assert c.get(f"/v1/files/{f['id']}").json() == f
        assert c.get("/v1/files").json()["data"][0]["id"] == f["id"]
        job = c.post("/v1/jobs", json=spec(data={"train": f["id"]}, train={"steps": 2})).json()
        assert service_daemon.wait_for(job["id"], {"succeeded"})["status"] == "succeeded"
        resolved = json.loads(
            (service_daemon.data_dir / "jobs" / job["id"] / "spec.json").read_text()
        )["resolved"]
        assert Path(resolved["train_path"]).read_bytes() == lines
        assert c.delete(f"/v1/files/{f['id']}").json() == {
            "id": f["id"],
            "object": "file",
            "deleted": True,
        }
        gone = c.get(f"/v1/files/{f['id']}")
        assert gone.status_code == 404
        assert gone.json()["error"]["code"] == "file_not_found"  # as job_not_found for jobs
        assert c.delete(f"/v1/files/{f['id']}").json()["error"]["code"] == "file_not_found"


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert "Traceback" not in r.text
    return body["error"]


@pytest.mark.parametrize(
    ("overrides", "param", "needle"),
    [
        ({"model": {"preset": "gpt5"}}, "model.preset", "'qwen3', 'llama'"),
        ({"model": {"preset": "qwen3", "dtype": "float8"}}, "model.dtype", "float32"),
        ({"train": {"lr": -0.1}}, "train.lr", "greater than 0"),
        ({"data": {"train": "synthetic", "seq_len": 50000}}, "data.seq_len", "40960"),
        (
            {"model": {"preset": "qwen3", "config": {"max_position_embeddings": 32}}},
            "data.seq_len",
            "maximum of 32",
        ),
        ({"data": {"train": "file-doesnotexist"}}, "data.train", "POST /v1/files"),
        ({"data": {"train": "/etc/passwd"}}, "data.train", "RP_DATASET_ROOTS"),
        ({"model": {"path": "/etc"}}, "model.path", "RP_MODEL_ROOTS"),
        ({"train": {"steps": 5, "epochs": 1}}, "train", "exactly one"),
        ({"engine": {"gpus": 0, "colour": "red"}}, "engine.colour", "Extra inputs"),
        # more micro-batches than the 8 sequences of a step (train.batch_size's default)
        ({"engine": {"gpus": 0, "num_microbatch": 9}}, "engine.num_microbatch", "at most 8"),
        # GRPO (docs/RL.md): its grader required, checked before anything is queued
        ({"train": {"objective": "grpo"}}, "grader", "needs a grader"),
        (
            {
                "train": {"objective": "grpo"},
                "grader": {"type": "python", "name": "p", "source": "def grade(s, i): return 1"},
            },
            "grader.type",
            "RP_ALLOW_PYTHON_GRADERS=1",
        ),
    ],
)
def test_bad_job_specs_are_422_naming_the_field(
    module_daemon: Daemon, overrides: dict, param: str, needle: str
) -> None:
    body = spec()
    for key, value in overrides.items():
        body[key] = value if key == "model" or key not in body else {**body[key], **value}
    with module_daemon.client() as c:
        err = _error(c.post("/v1/jobs", json=body), 422)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert needle in err["message"]


def test_paths_under_roots_only(make_daemon, tmp_path: Path) -> None:
    root = tmp_path / "datasets"
    root.mkdir()
    good = root / "d.jsonl"
    good.write_text('{"text": "hi"}\n')
    outside = tmp_path / "secret.jsonl"
    outside.write_text('{"text": "no"}\n')
    (root / "link.jsonl").symlink_to(outside)
    daemon: Daemon = make_daemon(RP_DATASET_ROOTS=str(root))
    with daemon.client() as c:
        ok = c.post("/v1/jobs", json=spec(data={"train": str(good)}, train={"steps": 1}))
        assert ok.status_code == 201, ok.text
        for bad in (str(root / ".." / "secret.jsonl"), str(root / "link.jsonl"), "d.jsonl"):
            err = _error(c.post("/v1/jobs", json=spec(data={"train": bad})), 422)
            assert err["param"] == "data.train" and err["code"] == "path_not_allowed", err
        # Missing and outside read alike, so a token holder cannot probe which files exist.
        missing, outside_err = (
            _error(c.post("/v1/jobs", json=spec(data={"train": p})), 422)
            for p in (str(root / "none"), str(outside))
        )
        assert missing["code"] == outside_err["code"] == "path_not_allowed"
        assert missing["message"].replace(str(root / "none"), "P") == outside_err[
            "message"
        ].replace(str(outside), "P")


def test_malformed_upload_names_the_first_bad_line(service_daemon: Daemon) -> None:
    body = b'{"text": "a"}\n\n{"text": "b"}\n{"text": oops}\n{"text": 1}\n'
    with service_daemon.client() as c:
        err = _error(c.post("/v1/files", files={"file": ("d.jsonl", body)}), 422)
        assert err["param"] == "file" and err["details"] == {"line": 4}
        assert "line 4" in err["message"]
        err = _error(c.post("/v1/files", files={"file": ("d.jsonl", b"\n\n")}), 422)
        assert "no records" in err["message"]
        err = _error(
            c.post(
                "/v1/files",
                files={"file": ("d.jsonl", b'{"text": "a"}\n')},
                data={"format": "chat"},
            ),
            422,
        )
        assert err["details"] == {"line": 1}
        assert c.get("/v1/files").json()["data"] == []


def test_size_limits_are_413(make_daemon) -> None:
    daemon: Daemon = make_daemon(RP_MAX_REQUEST_BYTES="2000", RP_MAX_UPLOAD_BYTES="1000")
    with daemon.client() as c:
        err = _error(c.post("/v1/jobs", json={**spec(), "name": "x" * 3000}), 413)
        assert err["type"] == "request_too_large"
        assert "RP_MAX_REQUEST_BYTES=2000 bytes" in err["message"]
        # Chunked (no Content-Length): counted while streaming.
        chunks = iter([b'{"name": "', b"y" * 3000, b'"}'])
        r = c.post("/v1/jobs", content=chunks, headers={"content-type": "application/json"})
        assert _error(r, 413)["type"] == "request_too_large"
        big = b'{"text": "' + b"z" * 2000 + b'"}\n'
        assert _error(c.post("/v1/files", files={"file": ("d.jsonl", big)}), 413)
        # Over the limit by its Content-Length: the setting's value is quoted, not the
        # limit with the multipart framing added (it said 66536).
        huge = b'{"text": "' + b"z" * 70_000 + b'"}\n'
        err = _error(c.post("/v1/files", files={"file": ("d.jsonl", huge)}), 413)
        assert "RP_MAX_UPLOAD_BYTES=1000 bytes" in err["message"], err
        small = b'{"text": "ok"}\n'
        assert c.post("/v1/files", files={"file": ("d.jsonl", small)}).status_code == 201


def test_unknown_ids_are_404(module_daemon: Daemon) -> None:
    with module_daemon.client() as c:
        for method, path in [
            ("GET", "/v1/jobs/job-nope"),
            ("POST", "/v1/jobs/job-nope/cancel"),
            ("POST", "/v1/jobs/job-nope/pause"),
            ("POST", "/v1/jobs/job-nope/resume"),
            ("GET", "/v1/jobs/job-nope/events"),
            ("GET", "/v1/jobs/job-nope/logs"),
            ("GET", "/v1/jobs/job-nope/metrics"),
            ("GET", "/v1/jobs/job-nope/checkpoints"),
            ("GET", "/v1/jobs/job-nope/checkpoints/5/content"),
            ("GET", "/v1/files/file-nope"),
            ("DELETE", "/v1/files/file-nope"),
        ]:
            err = _error(c.request(method, path), 404)
            assert err["type"] == "not_found_error"
        r = c.get("/v1/jobs/job-nope/events", headers={"Accept": "text/event-stream"})
        assert _error(r, 404)["type"] == "not_found_error"


def test_system_demo_metrics(service_daemon: Daemon) -> None:
    with service_daemon.client() as c:
        system = c.get("/v1/system").json()
        assert system["versions"]["python"].count(".") == 2
        assert system["devices"] == [] and system["queue_length"] == 0
        demo = c.get("/v1/demo").json()
        assert demo["model"]["preset"] in ("qwen3", "llama")
        job = c.post("/v1/jobs", json=demo)
        assert job.status_code == 201, job.text
        c.post(f"/v1/jobs/{job.json()['id']}/cancel")
        text = c.get("/metrics").text
        assert 'rp_jobs{status="cancelled"}' in text or 'rp_jobs{status="cancelling"}' in text
        assert "rp_request_duration_seconds_bucket" in text
        assert "rp_queue_length" in text and "rp_events_total" in text


def test_system_shows_which_job_holds_each_device_and_its_share(module_daemon: Daemon) -> None:
    """GET /v1/system's gpu_share: a running job's devices (virtual CPU devices on this
    GPU-less daemon) with the share its latest metrics event reported (the fake worker:
    50%, 4 jobs); none once it has stopped."""
    with module_daemon.client() as c:
        job_id = c.post("/v1/jobs", json=spec(train={"steps": 100000})).json()["id"]
        module_daemon.wait_for_step(job_id, 2)
        rows = [r for r in c.get("/v1/system").json()["gpu_share"] if r["job_id"] == job_id]
        assert rows and all(r["device"].startswith("cpu-virtual:") for r in rows)
        assert all(r["gpu"] is None and r["busy_fraction"] == 0.5 and r["jobs"] == 4 for r in rows)
        assert all(r["step"] >= 2 for r in rows)
        c.post(f"/v1/jobs/{job_id}/cancel")
        module_daemon.wait_for(job_id, {"cancelled"})
        assert not [r for r in c.get("/v1/system").json()["gpu_share"] if r["job_id"] == job_id]
