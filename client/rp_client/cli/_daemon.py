"""Starting `python -m rp_service` as a child process (for `rp serve` and `rp demo`)."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from .._client import Client
from .._token import DEFAULT_DATA_DIR
from ..errors import APIConnectionError, APIStatusError

INSTALL_HINT = (
    "the RoundPipe server is not installed in this Python environment "
    "(module rp_service not found). Install it on the machine with the GPUs: "
    "`pip install torch && pip install roundpipe-service`, or from a checkout of the "
    "repository: `pip install -e .`"
)


class DaemonStartError(RuntimeError):
    """The daemon exited, or did not become ready in time."""


def server_installed() -> bool:
    # find_spec locates the package without importing it (and so without importing torch).
    return importlib.util.find_spec("rp_service") is not None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def daemon_env(**settings: object) -> dict[str, str]:
    """This process's environment plus `RP_<NAME>` for each setting given (None: unset)."""
    env = dict(os.environ)
    for name, value in settings.items():
        if value is None:
            continue
        if isinstance(value, list | tuple):
            value = ",".join(str(v) for v in value)
        env[f"RP_{name.upper()}"] = str(value)
    return env


def dashboard_url(env: dict[str, str]) -> str:
    """Where a browser on this machine finds the daemon's dashboard (served at `/`)."""
    host = env.get("RP_HOST") or "127.0.0.1"
    if host in ("0.0.0.0", "::", ""):  # every interface: this machine reaches it on loopback
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{env.get('RP_PORT') or 8321}/"


def token_file(env: dict[str, str]) -> Path:
    """Where a daemon started with `env` keeps the token it makes: $RP_DATA_DIR/token."""
    return (Path(env.get("RP_DATA_DIR") or DEFAULT_DATA_DIR) / "token").resolve()


def start_daemon(env: dict[str, str], log: IO[bytes] | None = None) -> subprocess.Popen[bytes]:
    """Starts the daemon; its output goes to `log` (default: this terminal)."""
    return subprocess.Popen(
        [sys.executable, "-m", "rp_service"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT if log is not None else None,
    )


def exec_daemon(env: dict[str, str]) -> int:
    """Replaces this process with the daemon, so signals (docker stop's SIGTERM) reach it.

    Where exec is not available (Windows) the daemon runs as a child; returns its exit code.
    """
    argv = [sys.executable, "-m", "rp_service"]
    if os.name == "posix":
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, argv, env)
    proc = subprocess.Popen(argv, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        # The console sent Ctrl-C to the daemon too; give it time to shut down cleanly.
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()


def wait_ready(client: Client, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Polls /readyz until the daemon answers 200; DaemonStartError if it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise DaemonStartError(
                f"the daemon exited with code {proc.returncode} before it was ready"
            )
        try:
            client.ready()
            return
        except (APIConnectionError, APIStatusError):
            pass
        if time.monotonic() > deadline:
            raise DaemonStartError(f"the daemon was not ready after {timeout_s:g} s")
        time.sleep(0.25)


def stop_daemon(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """SIGTERM (graceful: running jobs checkpoint), then SIGKILL after `timeout_s`."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
