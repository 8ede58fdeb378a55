"""`Annotated` dependency aliases: the routes' only way to reach the services."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from rp_service.jobs.files import FileService
from rp_service.jobs.orchestrator import Orchestrator
from rp_service.jobs.outputs import JobOutputs
from rp_service.jobs.store import Store
from rp_service.settings import Settings
from rp_service.system import SystemProbe

__all__ = [
    "FilesDep",
    "OrchestratorDep",
    "OutputsDep",
    "Services",
    "ServicesDep",
]


@dataclass(frozen=True, slots=True)
class Services:
    """Everything the routes call, built once per app in `create_app`."""

    settings: Settings
    store: Store
    orchestrator: Orchestrator
    outputs: JobOutputs
    files: FileService
    system: SystemProbe


# `async def`, each of them: FastAPI runs a plain `def` dependency on a worker thread, a
# thread hop (and a turn of the GIL) per request for an attribute read.
async def get_services(request: Request) -> Services:
    return request.app.state.services


async def get_orchestrator(request: Request) -> Orchestrator:
    return request.app.state.services.orchestrator


async def get_outputs(request: Request) -> JobOutputs:
    return request.app.state.services.outputs


async def get_files(request: Request) -> FileService:
    return request.app.state.services.files


ServicesDep = Annotated[Services, Depends(get_services)]
OrchestratorDep = Annotated[Orchestrator, Depends(get_orchestrator)]
OutputsDep = Annotated[JobOutputs, Depends(get_outputs)]
FilesDep = Annotated[FileService, Depends(get_files)]
