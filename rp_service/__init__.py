"""RoundPipe Service: the training daemon (FastAPI app, job store, orchestrator, worker).

`create_app`, `Settings` and `JobSpec` are loaded on first use, so the job worker, which
imports this package too, does not pay for FastAPI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["JobSpec", "Settings", "__version__", "create_app"]

if TYPE_CHECKING:
    from rp_service.app import create_app
    from rp_service.schemas import JobSpec
    from rp_service.settings import Settings

_LAZY = {
    "create_app": "rp_service.app",
    "JobSpec": "rp_service.schemas",
    "Settings": "rp_service.settings",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rp_service' has no attribute {name!r}")
