"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter

from rp_service.api.deps import ServicesDep
from rp_service.errors import NotReady
from rp_service.schemas import Health, Ready

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """Liveness: the process answers. Never needs the token."""
    return Health()


@router.get("/readyz", response_model=Ready, responses={503: {"description": "not ready"}})
async def readyz(services: ServicesDep) -> Ready:
    """Readiness: store open, start-up reconcile done, orchestrator scheduling."""
    if not services.orchestrator.ready:
        raise NotReady("the daemon is starting or stopping; retry shortly")
    return Ready(store=True, orchestrator=True, devices=len(services.orchestrator.gpu_ids))
