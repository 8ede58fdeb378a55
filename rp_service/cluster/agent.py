"""The Ray actor on each node of a multi-node job: runs that node's rank as a process.

The rank is `python -m rp_service.cluster.rank JOB_DIR`, the worker's loop in a process of
its own, as on one box: the actor only starts it, hands its output lines to the driver,
passes signals on, and kills it. The rank's process asks the kernel to kill it when the
actor dies (the worker's parent-death signal), so a node that leaves the cluster leaves no
rank behind. This module does not import ray: the driver wraps `RankAgent` with
`ray.remote` itself.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

__all__ = ["RankAgent"]

_MAX_LINES = 10_000  # lines kept between two takes (the driver takes every 0.1 s)


class RankAgent:
    """One rank's process on this node, and its output lines not yet taken."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._out: list[str] = []
        self._err: list[str] = []
        self._readers: list[threading.Thread] = []

    def node(self) -> dict[str, Any]:
        """This node's address, Ray id and a free TCP port (rank 0's rendezvous port)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return {
            "address": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "port": port,
        }

    def missing(self, paths: dict[str, str]) -> dict[str, str]:
        """The entries of `paths` (field -> path) that this node does not have."""
        return {field: path for field, path in paths.items() if not Path(path).exists()}

    def start(self, job_dir: str, env: dict[str, str]) -> int:
        """Start the rank's process with `env` over this actor's environment (which holds
        the CUDA_VISIBLE_DEVICES Ray chose); returns its pid."""
        full_env = {**os.environ, **env}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "rp_service.cluster.rank", job_dir],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=full_env,
            start_new_session=True,  # its own group: a signal reaches its children too
        )
        assert self._proc.stdout is not None and self._proc.stderr is not None
        for stream, sink in ((self._proc.stdout, self._out), (self._proc.stderr, self._err)):
            reader = threading.Thread(
                target=self._read, args=(stream, sink), name="rp-rank-reader", daemon=True
            )
            reader.start()
            self._readers.append(reader)
        return self._proc.pid

    def _read(self, stream: IO[bytes], sink: list[str]) -> None:
        for raw in stream:
            with self._lock:
                if len(sink) < _MAX_LINES:
                    sink.append(raw.decode("utf-8", "replace").rstrip("\n"))

    def take(self) -> tuple[list[str], list[str], int | None]:
        """The stdout and stderr lines since the last take, and the exit status once the
        process has ended and its output is all read (None before)."""
        code = self._proc.poll() if self._proc is not None else None
        if code is not None:
            for reader in self._readers:  # the last lines, before the status says "done"
                reader.join(timeout=5.0)
        with self._lock:  # copied and emptied in place: the readers hold these lists
            out, err = list(self._out), list(self._err)
            self._out.clear()
            self._err.clear()
        return out, err, code

    def signal(self, signum: int) -> None:
        """Send `signum` to the rank's process group, if it runs."""
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def kill(self) -> None:
        """SIGKILL the rank's process group and reap it."""
        self.signal(signal.SIGKILL)
        if self._proc is not None:
            self._proc.wait()
