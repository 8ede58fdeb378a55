"""The image's command line, run outside Docker: it starts the daemon, which answers /healthz.

The command is read from docker/Dockerfile (ENTRYPOINT + CMD), so this fails when the
Dockerfile names a command the project does not install or that ignores the RP_ settings.
The container's own environment (RP_HOST=0.0.0.0, RP_DATA_DIR=/data) is swapped for a
loopback address, a free port and a temporary data directory.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.unit.docker.test_docker_files import entrypoint_argv, healthcheck_argv

TOKEN = "entrypoint-test-token"
START_TIMEOUT_S = 120.0  # importing torch on a busy 2-core CI machine
STOP_TIMEOUT_S = 30.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _resolve(argv: list[str]) -> list[str]:
    """argv with its program found on PATH, this interpreter's scripts directory first."""
    if argv[0] in ("python", "python3"):
        return [sys.executable, *argv[1:]]
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    program = shutil.which(argv[0], path=search)
    if program is None:
        pytest.fail(
            f"the Dockerfile's entrypoint {argv[0]!r} is not installed: pip install ./client"
        )
    return [program, *argv[1:]]


def _daemon_env(port: int, data_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("RP_")}
    env.update(
        RP_HOST="127.0.0.1",
        RP_PORT=str(port),
        RP_DATA_DIR=str(data_dir),
        RP_TOKEN=TOKEN,
        RP_GPUS="none",
        RP_LOG_LEVEL="info",
    )
    return env


def _wait_healthy(proc: subprocess.Popen[bytes], port: int, log: Path) -> httpx.Response:
    deadline = time.monotonic() + START_TIMEOUT_S
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5.0) as client:
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"the entrypoint exited with code {proc.returncode} before /healthz "
                    f"answered; its output:\n{log.read_text(errors='replace')[-4000:]}"
                )
            try:
                response = client.get("/healthz")
                if response.status_code == 200:
                    return response
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"/healthz did not answer 200 within {START_TIMEOUT_S:g} s; output:\n"
                    f"{log.read_text(errors='replace')[-4000:]}"
                )
            time.sleep(0.25)


def test_entrypoint_starts_the_daemon_and_answers_healthz(tmp_path):
    argv = _resolve(entrypoint_argv())
    port = _free_port()
    data_dir = tmp_path / "data"
    log = tmp_path / "daemon.log"
    env = _daemon_env(port, data_dir)

    with log.open("wb") as out:
        # A session of its own: whatever the entrypoint starts can be cleaned up as a group.
        proc = subprocess.Popen(
            argv,
            env=env,
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        response = _wait_healthy(proc, port, log)
        assert response.json() == {"status": "ok"}

        # RP_DATA_DIR is honoured: the store is created there.
        assert (data_dir / "rp.sqlite3").exists(), sorted(p.name for p in data_dir.iterdir())

        # RP_TOKEN is honoured: the API wants it, /healthz (the container's check) does not.
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0) as client:
            assert client.get("/v1/jobs").status_code == 401
            authed = client.get("/v1/jobs", headers={"Authorization": f"Bearer {TOKEN}"})
            assert authed.status_code == 200, authed.text

        # The image's HEALTHCHECK command passes against it.
        check = _resolve(healthcheck_argv())
        result = subprocess.run(
            check, env=env, capture_output=True, text=True, timeout=30, check=False
        )
        assert result.returncode == 0, result.stdout + result.stderr

        # `docker stop` sends SIGTERM to the entrypoint: the daemon itself must shut down
        # (and so checkpoint running jobs), not be left behind for Docker's SIGKILL.
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the entrypoint did not exit within {STOP_TIMEOUT_S:g} s of SIGTERM")
        assert code in (0, -signal.SIGTERM, 128 + signal.SIGTERM), code
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while _port_open(port) and time.monotonic() < deadline:
            time.sleep(0.25)
        assert not _port_open(port), (
            "the entrypoint exited on SIGTERM but the daemon it started still listens: "
            "`rp serve` must pass SIGTERM on to the daemon (or exec it)"
        )

        # ... and the health check now fails, as Docker would see it.
        result = subprocess.run(
            check, env=env, capture_output=True, text=True, timeout=30, check=False
        )
        assert result.returncode != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the session started above, nothing else
        except ProcessLookupError:
            pass
