"""rp_client: the Python SDK for the RoundPipe Service (sync `Client`, async `AsyncClient`)."""

from __future__ import annotations

from ._base import DEFAULT_BASE_URL
from ._chat import ChatReply, ChatUsage
from ._client import AsyncClient, Client
from .errors import (
    APIConnectionError,
    APIError,
    APIStatusError,
    APITimeoutError,
    Conflict,
    NotFound,
    RequestTooLarge,
    ServerError,
    TooManyRequests,
    Unauthorized,
    ValidationError,
)
from .models import (
    TERMINAL_STATUSES,
    Checkpoint,
    Cluster,
    ClusterNode,
    Event,
    File,
    FileDeleted,
    GpuShare,
    Job,
    JobDeleted,
    JobError,
    JobMetrics,
    JobProgress,
    JobSpec,
    LogChunk,
    Page,
    ParameterCounts,
    System,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_BASE_URL",
    "TERMINAL_STATUSES",
    "APIConnectionError",
    "APIError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncClient",
    "ChatReply",
    "ChatUsage",
    "Checkpoint",
    "Client",
    "Cluster",
    "ClusterNode",
    "Conflict",
    "Event",
    "File",
    "FileDeleted",
    "GpuShare",
    "Job",
    "JobDeleted",
    "JobError",
    "JobMetrics",
    "JobProgress",
    "JobSpec",
    "LogChunk",
    "NotFound",
    "Page",
    "ParameterCounts",
    "RequestTooLarge",
    "ServerError",
    "System",
    "TooManyRequests",
    "Unauthorized",
    "ValidationError",
    "__version__",
]
