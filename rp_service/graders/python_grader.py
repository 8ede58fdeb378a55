"""`python`: the user's `grade(sample, item)` in a sandboxed subprocess, reused per batch.

The child (`_sandbox_child.py`) isolates itself before it compiles the source: a network
namespace of its own where the box permits one (Linux, root or user namespaces), else an
audit hook that refuses sockets; resource limits (address space, CPU, file size, open
files, processes); the `nobody` user when the daemon runs as root; a work directory of its
own, writes outside it refused by the audit hook. This side bounds each sample's wall time
and each batch's, kills the child's whole process group on a timeout and starts a fresh
one for the next sample. docs/RL.md#graders states what each layer does and does not stop.
"""

from __future__ import annotations

import ast
import json
import logging
import math
import os
import select
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .base import GraderConfigError, GradeResult, Sample
from .spec import PythonGrader

__all__ = ["PythonSandboxGrader", "SandboxLimits"]

log = logging.getLogger(__name__)

_CHILD_SOURCE = Path(__file__).with_name("_sandbox_child.py")
_NOBODY = 65534


@dataclass(frozen=True, kw_only=True, slots=True)
class SandboxLimits:
    """What one python grader's process may use."""

    mem_bytes: int = 2 << 30
    # Cumulative over the process's life (it serves many batches); the wall timeouts below
    # are what stop a hung sample, this only ends a process that has burned CPU for long.
    cpu_s: int = 600
    file_bytes: int = 64 << 20
    open_files: int = 64
    # Processes the grader may start over its life (audit hook), and RLIMIT_NPROC for the
    # `nobody` user (which counts that user's processes box-wide, hence the headroom).
    max_processes: int = 4
    nproc: int = 32
    sample_timeout_s: float = 10.0
    batch_timeout_s: float = 300.0
    start_timeout_s: float = 20.0
    # Run as `nobody` when the daemon is root and `nobody` can run this Python.
    drop_user: bool = True
    # The audit hook's socket and write refusals; tests turn them off to check the
    # namespaces alone.
    audit_network: bool = True
    audit_writes: bool = True
    # A process the grader starts runs without the audit hook and as the grader's user, so
    # only a sandbox that runs as `nobody` may start any; tests of the count turn this on.
    unconfined_processes: bool = False


class PythonSandboxGrader:
    """Scores samples by calling the source's `grade(sample, item)` in a sandboxed process.

    A sample whose call raises, returns a non-number or runs past its timeout scores 0.0
    and counts as an error; the process is reused across batches until a timeout kills it.
    """

    def __init__(
        self,
        spec: PythonGrader,
        *,
        workdir: Path,
        field: str = "grader",
        limits: SandboxLimits | None = None,
    ) -> None:
        self.name = spec.name
        self._source = spec.source
        _check_source(spec.source, field=f"{field}.source")
        self._workdir = Path(workdir).resolve()
        self._limits = limits or SandboxLimits()
        self._proc: subprocess.Popen[bytes] | None = None
        self._buffer = b""
        # What the last started process achieved (tests and logs read it).
        self.isolation: dict[str, Any] = {}
        self.load_error: str | None = None

    def grade(self, samples: Sequence[Sample], items: Sequence[Mapping[str, Any]]) -> GradeResult:
        """One score per sample; failures and timeouts are 0.0, counted, never raised."""
        if len(samples) != len(items):
            raise ValueError(f"{len(samples)} samples but {len(items)} items")
        deadline = time.monotonic() + self._limits.batch_timeout_s
        scores: list[float] = []
        details: list[str | None] = []
        for sample, item in zip(samples, items, strict=True):
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                score, detail = 0.0, "TimeoutError: the batch's time limit was spent first"
            else:
                score, detail = self._grade_one(
                    sample, item, min(left_s, self._limits.sample_timeout_s)
                )
            scores.append(score)
            details.append(detail)
        result = GradeResult.of(scores, details, {self.name: list(scores)})
        if result.errors:
            first = next(d for d in details if d)
            log.info(
                "python grader %s: %d of %d samples failed, first: %s",
                self.name,
                result.errors,
                len(details),
                first,
            )
        return result

    def close(self) -> None:
        """Ends the sandbox process and everything it started."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()

    def __del__(self) -> None:
        if getattr(self, "_proc", None) is not None:
            self.close()

    def _grade_one(
        self, sample: Sample, item: Mapping[str, Any], timeout_s: float
    ) -> tuple[float, str | None]:
        try:
            if self._proc is None:
                self._start()
            if self.load_error is not None:
                return 0.0, f"PythonGraderError: the source did not load: {self.load_error}"
            request = {
                "sample": {
                    "output_text": sample.output_text,
                    "output_json": sample.output_json,
                    "output_tools": [],
                },
                "item": dict(item),
            }
            self._send(request)
            reply = self._receive(timeout_s)
        except (OSError, ValueError, TypeError, TimeoutError) as exc:
            # A dead or hung process: the next sample gets a fresh one.
            self.close()
            return 0.0, f"{type(exc).__name__}: {exc}"
        if "error" in reply:
            return 0.0, f"PythonGraderError: {reply['error']}"
        value = reply.get("score")
        if not isinstance(value, int | float) or not math.isfinite(value):
            return 0.0, f"bad reply {reply!r}"
        return float(value), None

    def _start(self) -> None:
        self._workdir.mkdir(parents=True, exist_ok=True)
        drop = self._limits.drop_user and os.geteuid() == 0 and _others_can_run_python()
        if drop:
            os.chown(self._workdir, _NOBODY, _NOBODY)
        config = {
            "workdir": str(self._workdir),
            "source": self._source,
            "mem_bytes": self._limits.mem_bytes,
            "cpu_s": self._limits.cpu_s,
            "file_bytes": self._limits.file_bytes,
            "open_files": self._limits.open_files,
            "max_processes": self._limits.max_processes,
            "nproc": self._limits.nproc,
            "drop_user": drop,
            "audit_network": self._limits.audit_network,
            "audit_writes": self._limits.audit_writes,
            "unconfined_processes": self._limits.unconfined_processes,
        }
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(self._workdir),
            "TMPDIR": str(self._workdir),
            "LANG": "C.UTF-8",
        }
        with open(self._workdir / "grader.log", "ab") as log_file:
            # -I: no PYTHONPATH, user site or cwd on sys.path; -B: no .pyc writes.
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-B", "-c", _CHILD_SOURCE.read_text(), json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                cwd=self._workdir,
                env=env,
                start_new_session=True,  # its own process group: one killpg ends all it started
            )
        self._buffer = b""
        hello = self._receive(self._limits.start_timeout_s)
        self.isolation = dict(hello.get("hello") or {})
        self.load_error = hello.get("load_error")
        log.info("python grader %s: sandbox started, %s", self.name, self.isolation)

    def _send(self, request: dict[str, Any]) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(request).encode() + b"\n")
        self._proc.stdin.flush()

    def _receive(self, timeout_s: float) -> dict[str, Any]:
        """The child's next line, waiting at most `timeout_s`; TimeoutError past it."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise TimeoutError(f"grade() ran past {timeout_s:.3g} s")
            ready, _, _ = select.select([fd], [], [], left_s)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    code = self._proc.poll()
                    raise OSError(f"the grader process ended (exit {code}); see grader.log")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        reply = json.loads(line)
        if not isinstance(reply, dict):
            raise ValueError(f"bad reply {line[:200]!r}")
        return reply


def _others_can_run_python() -> bool:
    """Whether a user other than the owner can reach this interpreter and its library.

    A Python installed under /root (pyenv in our CI image) is not: dropping to `nobody`
    would leave the child unable to import anything, so it stays root there.
    """
    for top in {Path(sys.prefix), Path(sys.base_prefix), Path(os.__file__).parent}:
        for folder in (top, *top.parents):
            if not folder.stat().st_mode & stat.S_IXOTH:
                return False
    return True


def _check_source(source: str, *, field: str) -> None:
    """Refuses source that does not parse or defines no top-level `grade` function."""
    try:
        tree = ast.parse(source, filename="grader.py")
    except SyntaxError as exc:
        raise GraderConfigError(
            f"does not parse: {exc.msg} (line {exc.lineno})", field=field
        ) from None
    names = {
        node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    if "grade" not in names:
        raise GraderConfigError("defines no top-level function grade(sample, item)", field=field)
