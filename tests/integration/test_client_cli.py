"""The `rp` command against a real daemon on loopback, run as a user runs it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import httpx
import yaml

# client_fixtures puts client/ on sys.path, so the SDK's names come through it.
from .client_fixtures import (  # noqa: F401  (fixtures)
    ROOT,
    TOKEN,
    Daemon,
    client_fixture,
    daemon_fixture,
    free_port,
    tiny_spec,
)

RP_TIMEOUT_S = 300


def rp_env(daemon: Daemon | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("RP_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "client"), str(ROOT)])
    if daemon is not None:
        env.update(RP_URL=daemon.url, RP_TOKEN=TOKEN)
    env.update(extra)
    return env


def rp(*args: str, daemon: Daemon | None = None, cwd: Path | None = None, **env: str):
    return subprocess.run(
        [sys.executable, "-m", "rp_client", *args],
        env=rp_env(daemon, **env),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=RP_TIMEOUT_S,
        check=False,
    )


def write_spec(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec))
    return path


def test_submit_follow_status_jobs_checkpoints_download_logs(daemon, tmp_path):
    spec = write_spec(tmp_path / "spec.yaml", tiny_spec(steps=12, checkpoint_interval=5))
    submitted = rp("submit", str(spec), "--follow", daemon=daemon)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.splitlines()[0]
    assert job_id.startswith("job-")
    assert f"{job_id} succeeded; model: " in submitted.stdout
    assert "Traceback" not in submitted.stderr

    status = rp("status", job_id, "--json", daemon=daemon)
    assert status.returncode == 0 and json.loads(status.stdout)["status"] == "succeeded"
    assert "succeeded" in rp("status", job_id, daemon=daemon).stdout

    listed = rp("jobs", "--json", "--limit", "0", daemon=daemon)
    assert job_id in [json.loads(line)["id"] for line in listed.stdout.splitlines()]
    assert job_id in rp("jobs", daemon=daemon).stdout

    assert "10" in rp("checkpoints", job_id, daemon=daemon).stdout
    downloaded = rp("download", job_id, "-o", str(tmp_path), daemon=daemon)
    assert downloaded.returncode == 0, downloaded.stderr
    tar_path = Path(downloaded.stdout.strip())
    assert tar_path.parent == tmp_path and tarfile.is_tarfile(tar_path)
    model = rp("download", job_id, "--model-path", daemon=daemon)
    assert model.returncode == 0 and model.stdout.strip()

    logs = rp("logs", job_id, daemon=daemon)
    assert logs.returncode == 0, logs.stderr
    assert rp("logs", job_id, "--follow", daemon=daemon).stdout == logs.stdout


def test_pause_resume_cancel_and_follow_json(daemon, client, tmp_path):
    spec = write_spec(tmp_path / "long.yaml", tiny_spec(steps=100000, checkpoint_interval=0))
    job_id = rp("submit", str(spec), daemon=daemon).stdout.strip()
    deadline = time.monotonic() + 120
    while client.jobs.get(job_id).status != "running" and time.monotonic() < deadline:
        time.sleep(0.2)

    paused = rp("pause", job_id, daemon=daemon)
    assert paused.returncode == 0 and paused.stdout.split()[1] in ("pausing", "paused")
    while client.jobs.get(job_id).status != "paused" and time.monotonic() < deadline:
        time.sleep(0.2)
    resumed = rp("resume", job_id, daemon=daemon)
    assert resumed.returncode == 0, resumed.stderr
    cancelled = rp("cancel", job_id, daemon=daemon)
    assert cancelled.returncode == 0, cancelled.stderr

    followed = rp("follow", job_id, "--json", daemon=daemon)
    assert followed.returncode == 1  # cancelled
    events = [json.loads(line) for line in followed.stdout.splitlines()]
    ids = [e["id"] for e in events]
    assert ids == sorted(set(ids))
    assert events[-1]["type"] == "status" and events[-1]["data"]["status"] == "cancelled"

    again = rp("resume", job_id, daemon=daemon)
    assert again.returncode == 2
    assert again.stderr.startswith("error: ") and len(again.stderr.splitlines()) == 1


def test_errors_are_one_line_with_the_right_exit_code(daemon, tmp_path):
    unknown = rp("status", "job-nope", daemon=daemon)
    assert unknown.returncode == 2
    assert unknown.stderr.startswith("error: ") and len(unknown.stderr.splitlines()) == 1

    wrong_token = rp("jobs", daemon=daemon, RP_TOKEN="wrong")
    assert wrong_token.returncode == 2 and wrong_token.stderr.startswith("error: ")

    bad = dict(tiny_spec())
    bad["train"] = {**bad["train"], "lr": -1}
    invalid = rp("submit", str(write_spec(tmp_path / "bad.yaml", bad)), daemon=daemon)
    assert invalid.returncode == 2 and "train.lr" in invalid.stderr
    assert "Traceback" not in invalid.stderr

    nowhere = rp("jobs", RP_URL=f"http://127.0.0.1:{free_port()}")
    assert nowhere.returncode == 1
    assert nowhere.stderr.startswith("error: connection to the RoundPipe daemon")


def test_upload_files_and_system(daemon, tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
    )
    uploaded = rp("upload", str(data), daemon=daemon)
    assert uploaded.returncode == 0, uploaded.stderr
    file_id = uploaded.stdout.strip()
    assert file_id.startswith("file-")
    assert file_id in rp("files", daemon=daemon).stdout
    assert rp("files", "--delete", file_id, daemon=daemon).returncode == 0
    assert file_id not in rp("files", daemon=daemon).stdout

    system = rp("system", daemon=daemon)
    assert system.returncode == 0 and "version" in system.stdout
    assert json.loads(rp("system", "--json", daemon=daemon).stdout)["version"]


def test_rp_serve_runs_the_daemon_and_stops_on_sigterm(tmp_path):
    port = free_port()
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rp_client",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--data-dir",
            str(tmp_path / "data"),
            "--gpus",
            "none",
        ],
        env=rp_env(None),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    token_file = tmp_path / "data" / "token"  # made by the daemon: no --token given
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            token = token_file.read_text().strip() if token_file.exists() else ""
            try:
                ready = httpx.get(
                    f"http://127.0.0.1:{port}/readyz",
                    headers={"Authorization": f"Bearer {token}"},
                    timeout=2,
                )
                if ready.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "rp serve: not ready"
            time.sleep(0.25)
        assert (tmp_path / "data" / "rp.sqlite3").exists()
        assert f"dashboard: http://127.0.0.1:{port}/" in (tmp_path / "serve.log").read_text()
        assert f"token: in {token_file}" in (tmp_path / "serve.log").read_text()
        page = httpx.get(f"http://127.0.0.1:{port}/", timeout=10)
        assert page.status_code == 200 and "/ui/app.js" in page.text
        proc.send_signal(signal.SIGTERM)  # reaches the daemon itself: rp serve execs it
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
    finally:
        log.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the session this test started
            proc.wait()


def test_rp_demo_end_to_end(tmp_path):
    """The first command a new user runs: a daemon, the demo job (real worker), the model."""
    data_dir = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "rp_client", "demo", "--data-dir", str(data_dir), "--gpus", "none"],
        env=rp_env(None),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    daemon_log = data_dir / "daemon.log"
    log_text = daemon_log.read_text(errors="replace")[-3000:] if daemon_log.exists() else ""
    assert result.returncode == 0, result.stderr[-3000:] + log_text
    line = next(ln for ln in result.stdout.splitlines() if " succeeded; model: " in ln)
    model_dir = Path(line.split(" succeeded; model: ")[1])
    assert model_dir.is_dir() and (model_dir / "config.json").exists()
    assert list(model_dir.glob("*.safetensors"))
    assert "stopping the daemon" in result.stderr
    assert re.search(r"dashboard: http://127\.0\.0\.1:\d+/ ", result.stderr)
    assert "Traceback" not in result.stderr


def test_rp_demo_fails_clearly_when_the_daemon_cannot_start(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rp_client",
            "demo",
            "--data-dir",
            str(tmp_path / "d"),
            "--start-timeout",
            "60",
        ],
        env=rp_env(None, RP_GPUS="bogus"),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 1
    assert "error: the daemon exited" in result.stderr
    assert "Traceback (most recent call last)" not in result.stderr.split("last lines of")[0]
