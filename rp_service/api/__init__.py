"""HTTP routers, one per noun; `deps.py` holds the dependency aliases they share."""

from __future__ import annotations

from rp_service.api import events, files, health, jobs, metrics, system

ROUTERS = [health.router, metrics.router, system.router, files.router, jobs.router, events.router]

__all__ = ["ROUTERS"]
