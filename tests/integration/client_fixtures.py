"""A real daemon on loopback for the client's integration tests (`python -m rp_service`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT / "client") not in sys.path:
    sys.path.insert(0, str(ROOT / "client"))

from rp_client import (  # noqa: E402  (re-exported for the test modules)
    AsyncClient,
    Client,
    Conflict,
    NotFound,
    Unauthorized,
    ValidationError,
)

__all__ = [
    "AsyncClient",
    "Client",
    "Conflict",
    "Daemon",
    "NotFound",
    "Unauthorized",
    "ValidationError",
    "tiny_spec",
]

TOKEN = "client-integration-token"
START_TIMEOUT_S = 180.0  # importing torch on a busy 2-core machine
STOP_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tiny_spec(steps: int = 4, **train: object) -> dict:
    """A job small enough for CPU CI: a two-layer qwen3, synthetic data."""
    return {
        "name": "client-test",
        "model": {
            "preset": "qwen3",
            "config": {
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 16,
                "vocab_size": 264,
                "max_position_embeddings": 128,
            },
            "dtype": "float32",
        },
        "data": {"train": "synthetic", "format": "text", "seq_len": 32},
        "train": {
            "steps": steps,
            "batch_size": 2,
            "lr": 1e-3,
            "warmup_steps": 0,
            "eval_interval": 0,
            "checkpoint_interval": 2,
            **train,
        },
        "engine": {"gpus": 0, "num_microbatch": 1},
    }


class Daemon:
    """`python -m rp_service` on a free loopback port, restartable on the same data dir."""

    def __init__(
        self, data_dir: Path, *, token: str | None = TOKEN, fake_worker: bool = True, **env: str
    ) -> None:
        self.data_dir = data_dir
        self.fake_worker = fake_worker
        self.extra_env = env
        self.port = free_port()
        self.token = token
        self.log_path = data_dir.parent / f"{data_dir.name}-daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("RP_")}
        env.update(
            RP_HOST="127.0.0.1",
            RP_PORT=str(self.port),
            RP_DATA_DIR=str(self.data_dir),
            RP_GPUS="none",
            RP_LOG_LEVEL="info",
            PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT), env.get("PYTHONPATH", "")]),
        )
        if self.fake_worker:
            # The server's stand-in worker (tests/integration/fake_worker.py): the protocol and
            # timing of a job without a model, so lifecycle tests are fast and deterministic.
            env.update(RP_WORKER_MODULE="fake_worker", FAKE_STEP_S="0.05")
        env.update(self.extra_env)
        if self.token:
            env["RP_TOKEN"] = self.token
        return env

    def client(self, **kwargs: object) -> Client:
        if self.token is None:  # the token the daemon made (RP_DATA_DIR/token)
            kwargs.setdefault("token_file", self.data_dir / "token")
        else:
            kwargs.setdefault("token", self.token)
        return Client(self.url, **kwargs)

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rp_service"],
                env=self.env(),
                cwd=self.data_dir.parent,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        with httpx.Client(timeout=5.0) as http:
            while True:
                token = self.token or _read(self.data_dir / "token")
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                if self.proc.poll() is not None:
                    pytest.fail(f"daemon exited ({self.proc.returncode}):\n{self.log_tail()}")
                try:
                    if http.get(f"{self.url}/readyz", headers=headers).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"daemon not ready in {START_TIMEOUT_S:g} s:\n{self.log_tail()}")
                time.sleep(0.25)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the session this fixture started
            proc.wait()

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


@pytest.fixture(scope="module", name="daemon")
def daemon_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon (with a token and the fake worker) shared by a test module."""
    d = Daemon(tmp_path_factory.mktemp("rp-client") / "data")
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module", name="real_daemon")
def real_daemon_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon with the real worker (rp_service.worker: torch on CPU devices)."""
    d = Daemon(tmp_path_factory.mktemp("rp-client-real") / "data", fake_worker=False)
    d.start()
    yield d
    d.stop()


@pytest.fixture(name="fresh_daemon")
def fresh_daemon_fixture(tmp_path: Path) -> Iterator[Daemon]:
    """A daemon of the test's own (for restarts), fake worker at 0.1 s a step."""
    d = Daemon(tmp_path / "data", FAKE_STEP_S="0.1")
    d.start()
    yield d
    d.stop()


@pytest.fixture(name="client")
def client_fixture(daemon: Daemon) -> Iterator[Client]:
    with daemon.client() as c:
        yield c
