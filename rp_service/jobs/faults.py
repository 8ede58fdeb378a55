"""Why a worker died, and whether trying again from its last checkpoint can help.

A worker that ends without reporting success, a pause or a cancel either failed on its own
terms (bad data, an invalid spec, a Python exception in training: it says so in an error
event, and trying again would fail the same way) or was ended from outside (a signal, a
driver fault, an exit with no final report): that is retried from the newest checkpoint.

The one outside death we can name is the kernel's OOM killer: the daemon samples the
worker's resident memory, and the memory in use against the limit, while it runs
(`MemoryWatch`) and reads the memory cgroup's ``oom_kill`` counter before and after; a
SIGKILL with that counter raised, or with either last sample near the limit, is reported as ``out_of_host_memory`` with the figures. That
one is not retried: the same spec on the same box meets the same limit again.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "HOST_OOM_ADVICE",
    "RETRYABLE_CODES",
    "Death",
    "MemoryWatch",
    "classify_death",
    "host_memory_limit",
    "host_memory_used",
    "oom_kill_count",
    "tree_rss_bytes",
]

# Worker error codes that name a fault of the machine, not of the job (see worker.py).
# node_lost, cluster_unreachable: a node of a multi-node job left the Ray cluster, or the
# cluster could not be reached (rp_service.cluster.driver).
RETRYABLE_CODES = frozenset({"device_fault", "node_lost", "cluster_unreachable"})

HOST_OOM_ADVICE = (
    "to use less host memory: train a LoRA adapter (train.method: lora), train fewer tokens "
    "per step (lower train.batch_size or data.seq_len), keep the optimizer state in lower "
    "precision, follow the host-memory plan of GET /v1/system, or run fewer jobs at once "
    "(RP_MAX_CPU_JOBS)"
)
_NEAR_LIMIT = 0.9  # sampled memory above this share of the limit counts as "near"
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a huge page-aligned number


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _cgroup_dirs() -> list[Path]:
    """This process's memory cgroup directory: v2 unified first, then v1 `memory`."""
    found = []
    for line in (_read(Path("/proc/self/cgroup")) or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        rel = rel.lstrip("/")
        if hierarchy == "0" and controllers == "":
            found.append(_CGROUP_ROOT / rel)
        elif "memory" in controllers.split(","):
            found.append(_CGROUP_ROOT / "memory" / rel)
            found.append(_CGROUP_ROOT / "memory")  # a container sees its own cgroup at the root
    return [d for d in found if d.is_dir()]


def host_memory_limit() -> tuple[int, str]:
    """The bytes this daemon's workers may use together, and where that figure comes from."""
    for directory in _cgroup_dirs():
        for name in ("memory.max", "memory.limit_in_bytes"):
            text = (_read(directory / name) or "").strip()
            if text.isdigit() and int(text) < _NO_LIMIT:
                return int(text), str(directory / name)
    for line in (_read(Path("/proc/meminfo")) or "").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024, "/proc/meminfo MemTotal"
    return 0, "unknown"


def host_memory_used(limit_source: str) -> int | None:
    """Bytes in use against the limit `host_memory_limit` named: the cgroup's usage less
    its reclaimable file cache (what `docker stats` shows), or MemTotal - MemAvailable."""
    if limit_source.startswith(str(_CGROUP_ROOT)):
        directory = Path(limit_source).parent
        for name in ("memory.current", "memory.usage_in_bytes"):
            text = (_read(directory / name) or "").strip()
            if text.isdigit():
                stat = dict(
                    line.split(" ", 1)
                    for line in (_read(directory / "memory.stat") or "").splitlines()
                )
                inactive = stat.get("inactive_file", stat.get("total_inactive_file", "0")).strip()
                return max(0, int(text) - int(inactive if inactive.isdigit() else 0))
        return None
    info = {}
    for line in (_read(Path("/proc/meminfo")) or "").splitlines():
        key, _, rest = line.partition(":")
        info[key] = int(rest.split()[0]) * 1024 if rest.split() else 0
    if "MemTotal" in info and "MemAvailable" in info:
        return info["MemTotal"] - info["MemAvailable"]
    return None


def oom_kill_count() -> int | None:
    """The memory cgroup's count of OOM kills so far (v2 memory.events, v1 oom_control)."""
    for directory in _cgroup_dirs():
        for name in ("memory.events", "memory.oom_control"):
            for line in (_read(directory / name) or "").splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and value.strip().isdigit():
                    return int(value)
    return None


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        out.extend(int(c) for c in (_read(task / "children") or "").split())
    return out


def _rss_bytes(pid: int) -> int:
    for line in (_read(Path(f"/proc/{pid}/status")) or "").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def tree_rss_bytes(pid: int) -> int:
    """Resident bytes of `pid` and its descendants (0 once it is gone)."""
    total, todo, seen = 0, [pid], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        total += _rss_bytes(current)
        todo.extend(_children(current))
    return total


@dataclass(slots=True)
class MemoryWatch:
    """What the daemon saw of one worker's host memory while it ran."""

    limit_bytes: int = 0
    limit_source: str = "unknown"
    oom_kills_before: int | None = None
    last_rss_bytes: int = 0
    peak_rss_bytes: int = 0
    # Memory in use against the limit by everything in it (other jobs too), last sample.
    last_used_bytes: int | None = None
    samples: int = 0

    @classmethod
    def begin(cls) -> MemoryWatch:
        limit, source = host_memory_limit()
        return cls(limit_bytes=limit, limit_source=source, oom_kills_before=oom_kill_count())

    def sample(self, pid: int) -> None:
        rss = tree_rss_bytes(pid)
        if rss:  # a zero means the process is already gone: keep the last real figure
            self.last_rss_bytes = rss
            self.peak_rss_bytes = max(self.peak_rss_bytes, rss)
            self.last_used_bytes = host_memory_used(self.limit_source)
            self.samples += 1

    def figures(self) -> dict[str, Any]:
        after = oom_kill_count()
        return {
            "rss_bytes": self.last_rss_bytes,
            "peak_rss_bytes": self.peak_rss_bytes,
            "used_bytes": self.last_used_bytes,
            "limit_bytes": self.limit_bytes,
            "limit_source": self.limit_source,
            "oom_kills": None
            if after is None or self.oom_kills_before is None
            else after - self.oom_kills_before,
        }


@dataclass(frozen=True, slots=True)
class Death:
    """How to settle a worker that failed: retry it or fail the job with `error`."""

    retry: bool
    reason: str
    error: dict[str, Any] = field(default_factory=dict)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def classify_death(
    returncode: int, last_error: dict[str, Any] | None, memory: dict[str, Any]
) -> Death:
    """Classify a failed worker exit (not a success, pause or cancel).

    `last_error` is the worker's last error event `{code, message, param}`, if any;
    `memory` is `MemoryWatch.figures()`.
    """
    killed_by = -returncode if returncode < 0 else None
    if last_error is not None and last_error.get("code") not in RETRYABLE_CODES:
        error = {**last_error, "code": last_error.get("code") or "worker_failed"}
        return Death(retry=False, reason=str(last_error["message"]), error=error)
    if killed_by == signal.SIGKILL and _near_limit(memory):
        rss, limit = memory["rss_bytes"], memory["limit_bytes"]
        oom_kills = memory.get("oom_kills")
        seen = f"the kernel's OOM killer ended the worker (cgroup oom_kill +{oom_kills}); "
        if not oom_kills:
            seen = "the worker was killed by SIGKILL while near the host memory limit; "
        used = memory.get("used_bytes")
        in_use = f", {_gib(used)} in use by all" if used else ""
        message = (
            f"out of host memory: {seen}its resident memory was {_gib(rss)}{in_use} of a "
            f"{_gib(limit)} limit ({memory['limit_source']}); {HOST_OOM_ADVICE}"
        )
        error = {"code": "out_of_host_memory", "message": message, "param": None}
        error["details"] = memory
        return Death(retry=False, reason=message, error=error)
    if last_error is not None:
        reason = str(last_error["message"])  # the worker names the device fault
    elif killed_by is not None:
        try:
            name = signal.Signals(killed_by).name
        except ValueError:
            name = "unknown"
        reason = f"worker killed by signal {killed_by} ({name})"
    elif returncode == 0:
        reason = "worker exited without reporting success"
    else:
        reason = f"worker exited with status {returncode} without reporting an error"
    code = (last_error.get("code") or "device_fault") if last_error is not None else "worker_failed"
    return Death(retry=True, reason=reason, error={"code": code, "message": reason, "param": None})


def _near_limit(memory: dict[str, Any]) -> bool:
    if memory.get("oom_kills"):
        return True
    limit = memory.get("limit_bytes") or 0
    if limit <= 0:
        return False
    used = max(memory.get("rss_bytes") or 0, memory.get("used_bytes") or 0)
    return used >= _NEAR_LIMIT * limit
