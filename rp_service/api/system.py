"""The box's facts and the embedded demo spec."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from rp_service.api.deps import ServicesDep
from rp_service.schemas import JobSpec, SystemInfo
from rp_service.system import load_demo_spec

router = APIRouter(prefix="/v1", tags=["system"])


@router.get("/system", response_model=SystemInfo)
async def get_system(services: ServicesDep) -> SystemInfo:
    """Versions, devices, memory, the C Adam build, queue length, jobs by status,
    each GPU's job and share of its work, and the Ray cluster's nodes (RP_RAY_ADDRESS)."""
    facts = await asyncio.to_thread(services.system.snapshot)
    counts = await asyncio.to_thread(services.store.count_by_status)
    share = services.orchestrator.gpu_share()  # on the loop, where the workers change
    cluster = await asyncio.to_thread(services.orchestrator.cluster_info)
    return SystemInfo(
        **facts,
        queue_length=counts.get("queued", 0),
        jobs=counts,
        gpu_share=share,
        cluster=cluster,
    )


@router.get("/demo", response_model=JobSpec)
async def get_demo() -> JobSpec:
    """The embedded demo JobSpec (what `rp demo` submits)."""
    return await asyncio.to_thread(load_demo_spec)
