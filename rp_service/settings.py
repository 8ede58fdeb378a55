"""Daemon settings, read from `RP_` environment variables (the only place that reads them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

__all__ = ["Settings"]


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
    gpus: str = "all"
    cpu_devices: int = Field(1, ge=1, le=64)
    max_cpu_jobs: int = Field(1, ge=1, le=64)
    model_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    dataset_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    max_upload_bytes: int = Field(1 << 30, ge=1)
    max_request_bytes: int = Field(1 << 20, ge=1)
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
    # Chat serving (rp_service/serving, docs/CHAT.md): a model's process stops after this
    # many seconds without a request, and must load within the second limit.
    serve_idle_s: float = Field(600.0, gt=0)
    serve_load_timeout_s: float = Field(600.0, gt=0)
    serving_module: str = "rp_service.serving"

    @field_validator("model_roots", "dataset_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: Any) -> Any:
        return _path_list(value)

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
        return self.data_dir / "jobs"

    def gpu_ids(self, visible: int) -> list[int]:
        """The GPU ids this daemon may hand out, given how many CUDA devices are visible."""
        if self.gpus == "none":
            return []
        if self.gpus == "all":
            return list(range(visible))
        return [int(p) for p in self.gpus.split(",") if int(p) < visible]
