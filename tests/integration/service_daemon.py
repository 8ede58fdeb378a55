"""A real daemon for the service tests: `python -m rp_service` on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """One daemon process; `restart()` keeps its data dir, `kill()` is `kill -9`."""

    def __init__(
        self,
        data_dir: Path,
        env: dict[str, str],
        *,
        preexec: Callable[[], None] | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.env = env
        self.preexec = preexec  # run in the child before exec (e.g. a lower open-file limit)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"daemon-{self.port}.log"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def token(self) -> str | None:
        """RP_TOKEN when given; else the token the daemon made in its data directory (None
        before it has, or with RP_AUTH=none)."""
        if self.env.get("RP_TOKEN"):
            return self.env["RP_TOKEN"]
        try:
            return (self.data_dir / "token").read_text().strip() or None
        except OSError:
            return None

    def headers(self) -> dict[str, str]:
        token = self.token
        return {"Authorization": f"Bearer {token}"} if token else {}

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers(), timeout=30, **kwargs)

    def start(self) -> None:
        env = {
            **os.environ,
            "RP_PORT": str(self.port),
            "RP_DATA_DIR": str(self.data_dir),
            "RP_GPUS": "none",
            "RP_WORKER_MODULE": "fake_worker",
            "RP_LOG_LEVEL": "info",
            # the caller's path after ours: packages installed outside site-packages (the GPU
            # machine's carried wheels) must reach the daemon too
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(HERE), str(REPO), os.environ.get("PYTHONPATH")) if p
            ),
            **self.env,
        }
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rp_service"],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=log,
            preexec_fn=self.preexec,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited: {self.log_path.read_text()[-3000:]}")
            try:
                r = httpx.get(f"{self.base_url}/readyz", headers=self.headers(), timeout=2)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"daemon not ready: {self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.port = free_port()
        self.start()

    def wait_for(self, job_id: str, statuses: set[str], timeout_s: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        job: dict[str, Any] = {}
        with self.client() as c:
            while time.monotonic() < deadline:
                job = c.get(f"/v1/jobs/{job_id}").json()
                if job.get("status") in statuses:
                    return job
                time.sleep(0.05)
        raise AssertionError(f"job {job_id} did not reach {statuses}: {job}")

    def wait_for_step(self, job_id: str, step: int, timeout_s: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        job: dict[str, Any] = {}
        with self.client() as c:
            while time.monotonic() < deadline:
                job = c.get(f"/v1/jobs/{job_id}").json()
                if (job.get("progress") or {}).get("step", 0) >= step:
                    return job
                time.sleep(0.05)
        raise AssertionError(f"job {job_id} did not reach step {step}: {job}")


def spec(**overrides: Any) -> dict[str, Any]:
    """A small valid JobSpec; `train`/`data`/`engine` overrides merge into their section."""
    body: dict[str, Any] = {
        "name": "t",
        "model": {"preset": "qwen3", "config": {"hidden_size": 32}},
        "data": {"train": "synthetic", "seq_len": 64},
        "train": {"steps": 20, "checkpoint_interval": 5},
        "engine": {"gpus": 0},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(body.get(key), dict):
            body[key] = {**body[key], **value}
        else:
            body[key] = value
    return body
