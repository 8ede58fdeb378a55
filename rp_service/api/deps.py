"""`Annotated` dependency aliases: the routes' only way to reach the services.

Each service is built once, in `create_app` (rp_service/services.py); a dependency only
reads it off the app.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from prometheus_client import CollectorRegistry

from rp_service.jobs.files import FileService
from rp_service.jobs.orchestrator import Orchestrator
from rp_service.jobs.outputs import JobOutputs
from rp_service.openai import Chat, FineTuning, Graders
from rp_service.services import Services
from rp_service.settings import Settings

__all__ = [
    "ChatDep",
    "FilesDep",
    "FineTuningDep",
    "GradersDep",
    "MetricsRegistryDep",
    "OrchestratorDep",
    "OutputsDep",
    "ServicesDep",
    "SettingsDep",
]


# `async def`, each of them: FastAPI runs a plain `def` dependency on a worker thread, a
# thread hop (and a turn of the GIL) per request for an attribute read.
async def get_services(request: Request) -> Services:
    return request.app.state.services


async def get_settings(request: Request) -> Settings:
    return request.app.state.services.settings


async def get_metrics_registry(request: Request) -> CollectorRegistry:
    return request.app.state.metrics_registry


async def get_orchestrator(request: Request) -> Orchestrator:
    return request.app.state.services.orchestrator


async def get_outputs(request: Request) -> JobOutputs:
    return request.app.state.services.outputs


async def get_files(request: Request) -> FileService:
    return request.app.state.services.files


async def get_chat(request: Request) -> Chat:
    return request.app.state.services.chat


async def get_graders(request: Request) -> Graders:
    return request.app.state.services.graders


async def get_fine_tuning(request: Request) -> FineTuning:
    return request.app.state.services.fine_tuning


ServicesDep = Annotated[Services, Depends(get_services)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsRegistryDep = Annotated[CollectorRegistry, Depends(get_metrics_registry)]
OrchestratorDep = Annotated[Orchestrator, Depends(get_orchestrator)]
OutputsDep = Annotated[JobOutputs, Depends(get_outputs)]
FilesDep = Annotated[FileService, Depends(get_files)]
ChatDep = Annotated[Chat, Depends(get_chat)]
FineTuningDep = Annotated[FineTuning, Depends(get_fine_tuning)]
GradersDep = Annotated[Graders, Depends(get_graders)]
