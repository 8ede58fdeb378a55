"""Daemon settings, read from `RP_` environment variables (the only place that reads them)."""

from __future__ import annotations

import ipaddress
import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

__all__ = ["Settings", "grader_python", "is_loopback", "python_graders_allowed"]


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, without a port) names this machine's loopback."""
    name = host.strip().strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _path_list(value: Any) -> Any:
    """Accept a JSON list or a comma-separated list of paths."""
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return []
        if text.startswith("["):
            return json.loads(text)
        return [part.strip() for part in text.split(",") if part.strip()]
    return value


class Settings(BaseSettings):
    """Everything the daemon can be told at start-up; see docs/API.md for the table."""

    model_config = SettingsConfigDict(env_prefix="RP_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8321, ge=0, le=65535)
    data_dir: Path = Path("./rp-data")
    token: SecretStr | None = None
    # "token" (default): a bearer token is required; without RP_TOKEN the daemon makes one
    # and writes it to $RP_DATA_DIR/token (0600). "none" turns auth off, loopback hosts only.
    auth: Literal["token", "none"] = "token"
    # Host header names accepted besides loopback ones and RP_HOST itself ("*": any name).
    allowed_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)
    gpus: str = "all"
    cpu_devices: int = Field(1, ge=1, le=64)
    max_cpu_jobs: int = Field(1, ge=1, le=64)
    model_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    dataset_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    max_upload_bytes: int = Field(1 << 30, ge=1)
    max_request_bytes: int = Field(1 << 20, ge=1)
    # Longest line of an uploaded jsonl file; the upload is refused (422) past it.
    max_line_bytes: int = Field(16 << 20, ge=1)
    # Uploads received at once; one more is answered 429 before its body is read.
    max_concurrent_uploads: int = Field(4, ge=1)
    # Jobs waiting in the queue; a submission past it is answered 429.
    max_queued: int = Field(1000, ge=1)
    # Free bytes the data directory must keep: below it a submission (and a checkpoint) is
    # refused with disk_full instead of leaving half-written files.
    min_free_bytes: int = Field(1 << 30, ge=0)
    # Checkpoints kept of a job once it has ended (the newest ones; 0: none).
    keep_finished_checkpoints: int = Field(1, ge=0)
    # Requests in progress at once (503 past it), how long an idle kept-alive connection
    # stays open, how long a new connection may take to send its request headers, and how
    # large those headers may be.
    max_connections: int = Field(1000, ge=1)
    keep_alive_s: int = Field(5, ge=1)
    header_timeout_s: float = Field(10.0, gt=0)
    max_header_bytes: int = Field(64 << 10, ge=1024)
    # Connections with no request in progress (new, half-sent, kept alive), in total (unset:
    # half of max_connections) and per client address: past either the oldest is closed
    # (rp_service/connections.py), so idle connections never crowd out requests.
    max_idle_connections: int | None = Field(None, ge=1)
    max_idle_connections_per_client: int = Field(256, ge=1)
    # A request body must arrive within body_timeout_s, plus 1 s per body_min_rate bytes
    # received (Apache's mod_reqtimeout body=20,MinRate=500); past it: 408, connection closed.
    body_timeout_s: float = Field(20.0, gt=0)
    body_min_rate: int = Field(500, ge=1)
    # Listen on <data dir>/rp.sock (0600) beside TCP; `rp` and the SDK on this machine
    # prefer it, so the token never goes to a TCP port another user may hold.
    unix_socket: bool = True
    # Interruptions that are not the job's fault (a daemon restart, a worker killed by a
    # signal or a device fault) are resumed from the last checkpoint this many times.
    max_attempts: int = Field(3, ge=1)
    # How often the daemon samples a worker's resident memory (to name an OOM kill).
    memory_sample_s: float = Field(1.0, gt=0)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    worker_module: str = "rp_service.worker"
    cancel_grace_s: float = Field(10.0, gt=0)
    # On shutdown running workers checkpoint (as on pause) for this long before SIGKILL;
    # docker/compose.yaml's stop_grace_period (120 s) leaves room for it.
    shutdown_grace_s: float = Field(90.0, gt=0)
    sse_ping_s: float = Field(15.0, gt=0)
    # Host bytes a job may use (bytes or with a unit: 96GiB, 100G); unset: the available
    # memory at start-up less a margin (engine.planning.memory_plan). Over it a submission gets 422.
    host_memory_budget: str | None = None
    # GPU memory each job's engine may use, in GiB (engine RoundPipe max_gpu_memory): its
    # plan sizes for a card that large and CUDA's allocator stops there, so a job leaves the
    # rest of a shared GPU free, or a 24 GB card is emulated on a larger one. Passed to each
    # worker as RP_GPU_MEMORY_GIB; a job's engine.max_gpu_memory_gib may ask for less.
    gpu_memory_gib: float | None = Field(None, gt=0, le=1 << 20)
    # Chat serving (rp_service/serving, docs/CHAT.md): a model's process stops after this
    # many seconds without a request, and must load within the second limit.
    serve_idle_s: float = Field(600.0, gt=0)
    serve_load_timeout_s: float = Field(600.0, gt=0)
    # A chat request's deadline, from its arrival (queue wait included): past it the
    # serving process stops generating it and the client gets 504.
    serve_request_timeout_s: float = Field(600.0, gt=0)
    # Requests that may wait behind the one a serving process generates; one more is 503.
    serve_max_queued: int = Field(8, ge=0)
    serving_module: str = "rp_service.serving"
    # A Ray cluster to run jobs with engine.nodes > 1 on (`auto`, `ray://head:10001`, or a
    # GCS address host:6379); unset, the daemon is one box and never imports ray.
    ray_address: str | None = None
    # A folder every node of that cluster mounts at this same path: job directories
    # (spec, staged datasets, checkpoints, outputs) live under it then (docs/SCALING.md).
    shared_dir: Path | None = None

    @field_validator("data_dir")
    @classmethod
    def _absolute_data_dir(cls, value: Path) -> Path:
        # Absolute once, at load: every path derived from it (job outputs, checkpoints,
        # `output_model_path`, `fine_tuned_model_checkpoint`) then names its file from any
        # working directory, not `rp-data/jobs/...` relative to where the daemon started.
        return value.expanduser().absolute()

    @field_validator("shared_dir")
    @classmethod
    def _absolute_shared_dir(cls, value: Path | None) -> Path | None:
        return None if value is None else value.expanduser().absolute()

    @field_validator("ray_address", mode="before")
    @classmethod
    def _empty_address_is_none(cls, value: Any) -> Any:
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("model_roots", "dataset_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: Any) -> Any:
        return _path_list(value)

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, value: Any) -> Any:
        return [str(h).strip().lower() for h in _path_list(value)]

    @model_validator(mode="after")
    def _auth_off_on_loopback_only(self) -> Settings:
        if self.auth == "none" and not is_loopback(self.host):
            raise ValueError(
                f"RP_AUTH=none turns authentication off, which is allowed only when the daemon "
                f"binds a loopback address (RP_HOST=127.0.0.1); RP_HOST is {self.host!r}. "
                "Keep RP_AUTH=token (the default) and give clients the token"
            )
        return self

    @model_validator(mode="after")
    def _idle_below_max(self) -> Settings:
        if self.max_idle_connections is not None and (
            self.max_idle_connections >= self.max_connections
        ):
            raise ValueError(
                f"RP_MAX_IDLE_CONNECTIONS ({self.max_idle_connections}) must be below "
                f"RP_MAX_CONNECTIONS ({self.max_connections}): idle connections have a "
                "cap of their own so that requests are always served"
            )
        return self

    @property
    def idle_connections(self) -> int:
        """RP_MAX_IDLE_CONNECTIONS, or half of RP_MAX_CONNECTIONS when it is unset."""
        if self.max_idle_connections is not None:
            return self.max_idle_connections
        return max(1, self.max_connections // 2)

    @field_validator("gpus")
    @classmethod
    def _check_gpus(cls, value: str) -> str:
        text = value.strip().lower()
        if text in ("all", "none", ""):
            return text or "none"
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts or not all(p.isdigit() for p in parts):
            raise ValueError("RP_GPUS must be 'all', 'none' or GPU ids like '0,1'")
        return ",".join(parts)

    @field_validator("host_memory_budget", mode="before")
    @classmethod
    def _check_budget(cls, value: Any) -> Any:
        from rp_service.jobs.hostmem import parse_budget_setting

        return parse_budget_setting(value) if isinstance(value, str) else value

    @field_validator("token", mode="before")
    @classmethod
    def _empty_token_is_none(cls, value: Any) -> Any:
        return None if value == "" else value

    @property
    def db_path(self) -> Path:
        return self.data_dir / "rp.sqlite3"

    @property
    def files_dir(self) -> Path:
        return self.data_dir / "files"

    @property
    def jobs_dir(self) -> Path:
        # On a Ray cluster every node reads and writes a job's directory: on the shared
        # folder then (the database and uploads stay in the data directory).
        if self.ray_address is not None and self.shared_dir is not None:
            return self.shared_dir / "jobs"
        return self.data_dir / "jobs"

    @property
    def token_path(self) -> Path:
        return self.data_dir / "token"

    @property
    def lock_path(self) -> Path:
        return self.data_dir / "daemon.lock"

    @property
    def socket_path(self) -> Path:
        """The Unix socket the daemon listens on beside TCP (RP_UNIX_SOCKET)."""
        return self.data_dir / "rp.sock"

    @property
    def spool_dir(self) -> Path:
        """Where request bodies are spooled while they arrive (not /tmp: other users')."""
        return self.data_dir / "tmp"

    def gpu_ids(self, visible: int) -> list[int]:
        """The GPU ids this daemon may hand out, given how many CUDA devices are visible."""
        if self.gpus == "none":
            return []
        if self.gpus == "all":
            return list(range(visible))
        return [int(p) for p in self.gpus.split(",") if int(p) < visible]


def python_graders_allowed() -> bool:
    """Whether the operator lets jobs run their own python graders (RP_ALLOW_PYTHON_GRADERS=1).

    Read on each call rather than through `Settings`, because the job worker asks too and
    does not build the daemon's settings.
    """
    return os.environ.get("RP_ALLOW_PYTHON_GRADERS", "").strip() == "1"


def grader_python() -> str | None:
    """The interpreter python graders run in (RP_GRADER_PYTHON), or None for the daemon's own.

    One that `nobody` can run (a system Python under /usr) lets a root daemon drop its
    graders to `nobody` where its own Python is private (docs/RL.md#graders).
    """
    return os.environ.get("RP_GRADER_PYTHON", "").strip() or None
