"""Safe by default on a shared box (issue 33): the token, the lock, private files, bounds.

Every daemon here is `python -m rp_service` on 127.0.0.1 with the fake worker.
"""

from __future__ import annotations

import os
import resource
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.service_daemon import HERE, REPO, Daemon, free_port, spec

TOKEN = "security-token"
_TERMINAL = {"succeeded", "failed", "cancelled"}


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _daemon_env(data_dir: Path, port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RP_")}
    env.update(
        RP_PORT=str(port),
        RP_DATA_DIR=str(data_dir),
        RP_GPUS="none",
        RP_WORKER_MODULE="fake_worker",
        PYTHONPATH=os.pathsep.join([str(HERE), str(REPO)]),
        **extra,
    )
    return env


def _rp(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("RP_")}
    full["PYTHONPATH"] = os.pathsep.join([str(REPO / "client"), str(REPO)])
    full.update(env)
    return subprocess.run(
        [sys.executable, "-m", "rp_client", *args],
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _wait(daemon: Daemon, job_id: str, statuses: set[str], timeout_s: float = 60) -> dict:
    return daemon.wait_for(job_id, statuses, timeout_s=timeout_s)


# ---------------------------------------------------------------- auth


def test_tokenless_daemon_requires_the_token_it_wrote_and_rp_reads_it(make_daemon) -> None:
    daemon: Daemon = make_daemon()
    token_file = daemon.data_dir / "token"
    assert _mode(token_file) == 0o600
    assert len(token_file.read_text().strip()) >= 40  # token_urlsafe(32)
    r = httpx.get(f"{daemon.base_url}/v1/jobs")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_token"
    assert httpx.get(f"{daemon.base_url}/healthz").status_code == 200  # liveness stays open
    with daemon.client() as c:
        job = c.post("/v1/jobs", json=spec(name="via-token-file", train={"steps": 2})).json()
    # `rp` on this machine finds the token through RP_DATA_DIR, none given to it
    listed = _rp("jobs", RP_URL=daemon.base_url, RP_DATA_DIR=str(daemon.data_dir))
    assert listed.returncode == 0, listed.stderr
    assert job["id"] in listed.stdout
    refused = _rp("jobs", RP_URL=daemon.base_url, RP_DATA_DIR=str(daemon.data_dir / "other"))
    assert refused.returncode == 2 and "token" in refused.stderr


def test_auth_off_is_refused_off_loopback_and_allowed_on_it(make_daemon, tmp_path: Path) -> None:
    env = _daemon_env(tmp_path / "open", free_port(), RP_AUTH="none", RP_HOST="0.0.0.0")
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "rp_service"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert "RP_AUTH=none" in proc.stderr and "loopback" in proc.stderr
    assert "Traceback" not in proc.stderr and time.monotonic() - started < 30
    daemon: Daemon = make_daemon(RP_AUTH="none")
    assert httpx.get(f"{daemon.base_url}/v1/jobs").status_code == 200
    assert not (daemon.data_dir / "token").exists()


def test_cross_site_posts_and_foreign_hosts_are_refused(make_daemon) -> None:
    daemon: Daemon = make_daemon(RP_TOKEN=TOKEN)
    upload = {"file": ("d.jsonl", b'{"text": "hello"}\n')}
    with daemon.client() as c:
        # A page of another site posts a multipart form (a "simple" request: no preflight).
        r = c.post("/v1/files", files=upload, headers={"Origin": "http://evil.example"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "cross_origin_refused"
        r = c.post("/v1/files", files=upload, headers={"Origin": "null"})
        assert r.status_code == 403
        r = c.delete("/v1/files/file-x", headers={"Origin": "http://evil.example"})
        assert r.status_code == 403
        assert c.get("/v1/files").json()["data"] == []  # nothing was stored
        # The daemon's own dashboard (same origin) may post.
        own = f"http://127.0.0.1:{daemon.port}"
        assert c.post("/v1/files", files=upload, headers={"Origin": own}).status_code == 201
        # DNS rebinding: a foreign name pointing at 127.0.0.1 is not a name of this daemon.
        r = c.get("/v1/jobs", headers={"Host": f"evil.example:{daemon.port}"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "host_not_allowed"
        assert c.get("/v1/jobs", headers={"Host": f"localhost:{daemon.port}"}).status_code == 200
    named: Daemon = make_daemon(RP_TOKEN=TOKEN, RP_ALLOWED_HOSTS="gpu-box.lan")
    with named.client() as c:
        assert c.get("/v1/jobs", headers={"Host": "gpu-box.lan:1"}).status_code == 200


# ---------------------------------------------------------------- the data directory


def test_a_second_daemon_exits_2_and_leaves_the_first_ones_worker(make_daemon) -> None:
    first: Daemon = make_daemon(RP_TOKEN=TOKEN, FAKE_STEP_S="0.2")
    with first.client() as c:
        job = c.post("/v1/jobs", json=spec(train={"steps": 100})).json()
    first.wait_for_step(job["id"], 1)
    workers = [p for p in _children(first.proc.pid) if p != first.proc.pid]
    assert len(workers) == 1
    env = _daemon_env(first.data_dir, free_port(), RP_TOKEN=TOKEN)
    second = subprocess.run(
        [sys.executable, "-m", "rp_service"], env=env, capture_output=True, text=True, timeout=60
    )
    assert second.returncode == 2, second.stderr
    assert f"pid {first.proc.pid}" in second.stderr and "Traceback" not in second.stderr
    os.kill(workers[0], 0)  # still alive
    step = first.wait_for_step(job["id"], 1)["progress"]["step"]
    later = first.wait_for_step(job["id"], step + 2)
    assert later["status"] == "running" and later["attempt"] == 1 and later["restarts"] == 0
    assert (first.data_dir / "daemon.lock").read_text().strip() == str(first.proc.pid)


def test_data_directory_and_files_are_private(make_daemon, tmp_path: Path) -> None:
    data = tmp_path / "data0"  # make_daemon's first data directory, made 0755 by hand
    data.mkdir(mode=0o755)
    os.chmod(data, 0o755)
    daemon: Daemon = make_daemon(RP_TOKEN=TOKEN)
    assert daemon.data_dir == data
    with daemon.client() as c:
        up = c.post("/v1/files", files={"file": ("d.jsonl", b'{"text": "a"}\n')}).json()
        job = c.post("/v1/jobs", json=spec(train={"steps": 5, "checkpoint_interval": 2})).json()
    _wait(daemon, job["id"], _TERMINAL)
    assert _mode(data) == 0o700
    job_dir = data / "jobs" / job["id"]
    files = [data / "rp.sqlite3", data / "daemon.lock", data / "files" / f"{up['id']}.jsonl"]
    files += [job_dir / "spec.json", job_dir / "worker.log"]
    for path in files:
        assert _mode(path) == 0o600, path
    for folder in (data / "files", data / "jobs", job_dir):
        assert _mode(folder) == 0o700, folder


# ---------------------------------------------------------------- bounded resources


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _low_open_files() -> None:
    # Below 200 + what the daemon needs; the daemon must raise it to the hard limit.
    resource.setrlimit(resource.RLIMIT_NOFILE, (150, 4096))


def test_idle_connections_do_not_stop_requests_or_fail_a_queued_job(tmp_path: Path) -> None:
    daemon = Daemon(
        tmp_path / "data",
        {"RP_TOKEN": TOKEN, "RP_HEADER_TIMEOUT_S": "3", "RP_MAX_CONNECTIONS": "400"},
        preexec=_low_open_files,
    )
    daemon.start()
    idle: list[socket.socket] = []
    try:
        for _ in range(200):
            sock = socket.create_connection(("127.0.0.1", daemon.port), timeout=5)
            sock.sendall(b"GET /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
            idle.append(sock)
        with daemon.client() as c:
            r = c.post("/v1/jobs", json=spec(train={"steps": 3}))
            assert r.status_code == 201, r.text
            assert c.get("/readyz").status_code == 200
        job = daemon.wait_for(r.json()["id"], _TERMINAL, timeout_s=60)
        assert job["status"] == "succeeded", job
        # The header deadline closes them, and the idle cap (200 here) the oldest
        # at once: each reads EOF, or a reset (closed before its bytes were read), within a
        # bounded wait; a timeout is one left open.
        deadline = time.monotonic() + 30
        closed = 0
        for sock in idle:
            sock.settimeout(max(deadline - time.monotonic(), 0.1))
            try:
                closed += sock.recv(1) == b""
            except ConnectionResetError:
                closed += 1
            except TimeoutError:
                closed += 0
        assert closed == len(idle)
    finally:
        for sock in idle:
            sock.close()
        daemon.stop()


def _latency_series(text: str) -> set[str]:
    return {
        line.split(" ")[0]
        for line in text.splitlines()
        if line.startswith("rp_request_duration_seconds_count")
    }


def test_made_up_methods_do_not_grow_metrics(make_daemon) -> None:
    daemon: Daemon = make_daemon(RP_TOKEN=TOKEN)
    with daemon.client() as c, httpx.Client(base_url=daemon.base_url) as anonymous:
        anonymous.request("BREW0", "/v1/jobs")
        c.get("/metrics")
        before = _latency_series(c.get("/metrics").text)
        for i in range(100):
            assert anonymous.request(f"BREW{i}X", "/v1/jobs").status_code in (401, 405)
        after = _latency_series(c.get("/metrics").text)
    assert after == before
    assert any('method="other"' in s for s in after)


def _peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_a_20_mib_line_is_422_and_memory_stays_bounded(make_daemon) -> None:
    daemon: Daemon = make_daemon(RP_TOKEN=TOKEN)
    line = b'{"text": "' + b"a" * (20 << 20) + b'"}\n'
    with httpx.Client(base_url=daemon.base_url, headers=daemon.headers(), timeout=120) as c:
        r = c.post("/v1/files", files={"file": ("big.jsonl", b'{"text": "ok"}\n' + line)})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["code"] == "line_too_long" and err["details"] == {"line": 2}
        assert "RP_MAX_LINE_BYTES" in err["message"]
        assert c.get("/v1/files").json()["data"] == []
    assert _peak_rss_bytes(daemon.proc.pid) < 300 << 20
    spooled = list((daemon.data_dir / "tmp").iterdir())  # spooled in the data dir, then gone
    assert spooled == [] and list((daemon.data_dir / "files").glob("*")) == []


def test_deeply_nested_line_is_422_with_its_line_number(make_daemon) -> None:
    daemon: Daemon = make_daemon(RP_TOKEN=TOKEN)
    nested = b'{"text": "x", "deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"
    with daemon.client() as c:
        r = c.post("/v1/files", files={"file": ("d.jsonl", b'{"text": "a"}\n\n' + nested)})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["details"] == {"line": 3}


def test_delete_a_finished_job_and_retention(make_daemon) -> None:
    daemon: Daemon = make_daemon(RP_TOKEN=TOKEN, FAKE_STEP_S="0.05")
    with daemon.client() as c:
        running = c.post("/v1/jobs", json=spec(train={"steps": 400})).json()
        done = c.post("/v1/jobs", json=spec(train={"steps": 8, "checkpoint_interval": 2})).json()
        daemon.wait_for_step(running["id"], 1)
        r = c.delete(f"/v1/jobs/{running['id']}")
        assert r.status_code == 409 and r.json()["error"]["code"] == "job_not_deletable"
        c.post(f"/v1/jobs/{running['id']}/cancel")
        _wait(daemon, done["id"], {"succeeded"})
        # RP_KEEP_FINISHED_CHECKPOINTS=1: the newest stays, on disk and listed.
        events = c.get(f"/v1/jobs/{done['id']}/events?limit=1000").json()["data"]
        saved = [e["data"]["step"] for e in events if e["type"] == "checkpoint"]
        assert len(saved) >= 3
        listed = c.get(f"/v1/jobs/{done['id']}/checkpoints").json()["data"]
        assert [p["step"] for p in listed] == [max(saved)]
        on_disk = sorted(
            p.name for p in (daemon.data_dir / "jobs" / done["id"]).glob("checkpoints/step-*")
        )
        assert on_disk == [f"step-{max(saved)}"]
        r = c.delete(f"/v1/jobs/{done['id']}")
        assert r.status_code == 200 and r.json() == {
            "id": done["id"],
            "object": "job",
            "deleted": True,
        }
        assert c.get(f"/v1/jobs/{done['id']}").status_code == 404
        assert c.get(f"/v1/jobs/{done['id']}/events").status_code == 404
        assert c.delete(f"/v1/jobs/{done['id']}").status_code == 404
        assert done["id"] not in [j["id"] for j in c.get("/v1/jobs").json()["data"]]
        assert not (daemon.data_dir / "jobs" / done["id"]).exists()
    _wait(daemon, running["id"], {"cancelled"})
    removed = _rp("rm", running["id"], RP_URL=daemon.base_url, RP_TOKEN=TOKEN)
    assert removed.returncode == 0 and f"{running['id']} deleted" in removed.stdout
    missing = _rp("rm", running["id"], RP_URL=daemon.base_url, RP_TOKEN=TOKEN)
    assert missing.returncode == 2


def test_queue_cap_and_free_space_floor(make_daemon) -> None:
    capped: Daemon = make_daemon(RP_TOKEN=TOKEN, RP_MAX_QUEUED="1", RP_GPUS="none")
    with capped.client() as c:
        first = c.post("/v1/jobs", json=spec(train={"steps": 400})).json()
        capped.wait_for(first["id"], {"running"})
        assert c.post("/v1/jobs", json=spec()).status_code == 201  # queued behind it
        r = c.post("/v1/jobs", json=spec())
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    full: Daemon = make_daemon(RP_TOKEN=TOKEN, RP_MIN_FREE_BYTES=str(1 << 62))
    with full.client() as c:
        r = c.post("/v1/jobs", json=spec())
        assert r.status_code == 507 and r.json()["error"]["code"] == "disk_full"
        assert "RP_MIN_FREE_BYTES" in r.json()["error"]["message"]


# ---------------------------------------------------------------- bad inputs


def test_integers_past_2_to_the_63_are_4xx(make_daemon) -> None:
    daemon: Daemon = make_daemon(RP_TOKEN=TOKEN)
    big = str(2**64)
    with daemon.client() as c:
        job = c.post("/v1/jobs", json=spec(train={"steps": 2})).json()
        _wait(daemon, job["id"], _TERMINAL)
        base = f"/v1/jobs/{job['id']}"
        hex_id = job["id"].removeprefix("job-")
        for path in (
            f"{base}/logs?offset={big}",
            f"{base}/events?after={big}",
            f"{base}/checkpoints/{big}/content",
            f"/v1/jobs?limit={big}",
            f"/v1/files?limit={big}",
            f"/v1/fine_tuning/jobs/{job['id']}/events?after=ftevent-{hex_id}-{big}",
            f"/v1/fine_tuning/jobs/{job['id']}/checkpoints?after=ftckpt-{hex_id}-{big}",
        ):
            r = c.get(path)
            assert 400 <= r.status_code < 500, (path, r.status_code, r.text)
        for last_event_id in (big, "-1", "1e3"):
            r = c.get(
                f"{base}/events",
                headers={"Accept": "text/event-stream", "Last-Event-ID": last_event_id},
            )
            assert r.status_code == 422, (last_event_id, r.text)
        assert c.get(f"{base}/logs?offset={2**63 - 1}").status_code == 200


def test_control_characters_in_a_name_are_422(make_daemon) -> None:
    daemon: Daemon = make_daemon(RP_TOKEN=TOKEN)
    with daemon.client() as c:
        for name in ("\x1b[2J\x1b[31mowned", "two\nlines", "rtl\u202eevil"):
            r = c.post("/v1/jobs", json=spec(name=name))
            assert r.status_code == 422, r.text
            assert r.json()["error"]["param"] == "name"
        assert c.post("/v1/jobs", json=spec(name="ünïcode ok — 1")).status_code == 201


def test_the_worker_environment_has_no_token(make_daemon) -> None:
    daemon: Daemon = make_daemon(RP_TOKEN=TOKEN, FAKE_STEP_S="0.2")
    with daemon.client() as c:
        job = c.post("/v1/jobs", json=spec(train={"steps": 100})).json()
    daemon.wait_for_step(job["id"], 1)
    (worker,) = _children(daemon.proc.pid)
    environ = Path(f"/proc/{worker}/environ").read_bytes().split(b"\0")
    names = {item.partition(b"=")[0] for item in environ}
    assert b"RP_DEVICES" in names and b"RP_TOKEN" not in names
    with daemon.client() as c:
        c.post(f"/v1/jobs/{job['id']}/cancel")


def test_stale_partial_uploads_are_removed_at_start(make_daemon, tmp_path: Path) -> None:
    files = tmp_path / "data0" / "files"
    files.mkdir(parents=True)
    (files / "file-dead.partial").write_bytes(b"half an upload")
    kept = files / "file-kept.jsonl"
    kept.write_bytes(b'{"text": "a"}\n')
    make_daemon(RP_TOKEN=TOKEN)
    assert sorted(p.name for p in files.iterdir()) == ["file-kept.jsonl"]


def test_openai_model_paths_check_the_roots_before_reading(make_daemon, tmp_path: Path) -> None:
    root = tmp_path / "models"
    root.mkdir()
    outside = tmp_path / "private-model"
    outside.mkdir()
    (outside / "config.json").write_text('{"max_position_embeddings": 64}')
    daemon: Daemon = make_daemon(RP_TOKEN=TOKEN, RP_MODEL_ROOTS=str(root))
    with daemon.client() as c:
        up = c.post("/v1/files", files={"file": ("d.jsonl", b'{"text": "a"}\n')}).json()
        errors = []
        for model in (str(outside), str(root / "missing"), "../private-model"):
            r = c.post("/v1/fine_tuning/jobs", json={"model": model, "training_file": up["id"]})
            assert r.status_code == 400, r.text
            errors.append(r.json()["error"])
    assert {e["code"] for e in errors} == {"model_not_found"}
    messages = {
        e["message"].replace(repr(m), "M")
        for e, m in zip(
            errors, (str(outside), str(root / "missing"), "../private-model"), strict=True
        )
    }
    assert len(messages) == 1  # outside and missing read alike


@pytest.mark.parametrize(("argv", "status"), [(["--help"], 0), (["--port", "9"], 2)])
def test_the_daemon_prints_help_and_refuses_arguments(
    tmp_path: Path, argv: list[str], status: int
) -> None:
    """`python -m rp_service --help` lists the RP_ settings; any other argument is refused;
    neither starts a daemon or writes a data directory (the default ./rp-data)."""
    done = subprocess.run(
        [sys.executable, "-m", "rp_service", *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == status, done.stderr
    if status == 0:
        assert "RP_PORT" in done.stdout and "RP_DATA_DIR" in done.stdout
    else:
        assert "unrecognized arguments: --port 9" in done.stderr
    assert list(tmp_path.iterdir()) == []
