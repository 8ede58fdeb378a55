"""`create_app(settings)`: the FastAPI app, its lifespan, guard middleware and error handler."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from prometheus_client import Histogram
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rp_service import __version__
from rp_service.api import ROUTERS, dashboard
from rp_service.api import openai as openai_api
from rp_service.api.deps import Services
from rp_service.api.metrics import build_registry
from rp_service.errors import ServiceError
from rp_service.jobs.events import EventHub
from rp_service.jobs.files import FileService
from rp_service.jobs.orchestrator import Orchestrator
from rp_service.jobs.outputs import JobOutputs
from rp_service.jobs.store import Store
from rp_service.settings import Settings
from rp_service.system import SystemProbe

__all__ = ["create_app"]

log = logging.getLogger(__name__)

_UPLOAD_OVERHEAD_BYTES = 64 * 1024  # multipart boundaries and headers around the file
_HTTP_ERROR_TYPES = {
    400: ("invalid_request_error", "bad_request"),
    401: ("authentication_error", "invalid_token"),
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    409: ("conflict_error", "conflict"),
    413: ("request_too_large", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
}


def _envelope(
    status: int,
    type_: str,
    code: str,
    message: str,
    *,
    param: str | None = None,
    details: Any = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {
        "error": {
            "type": type_,
            "code": code,
            "message": message,
            "param": param,
            "details": details,
        }
    }
    return JSONResponse(body, status_code=status, headers=headers)


class _BodyTooLarge(StarletteHTTPException):
    """Raised from inside `receive`; FastAPI re-raises HTTPExceptions met while reading."""


class _Guard:
    """Pure ASGI: bearer token, body size limits, request latency. Streams stay streams."""

    def __init__(self, app: ASGIApp, *, settings: Settings, latency: Histogram) -> None:
        self.app = app
        self.token = settings.token.get_secret_value().encode() if settings.token else None
        self.max_request_bytes = settings.max_request_bytes
        self.max_upload_bytes = settings.max_upload_bytes + _UPLOAD_OVERHEAD_BYTES
        self.latency = latency

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = {"code": 500}

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            refusal = self._refuse(scope)
            if refusal is not None:
                await refusal(scope, receive, send_status)
                return
            await self.app(scope, self._counted(scope, receive), send_status)
        finally:
            route = scope.get("route")
            self.latency.labels(
                scope["method"], getattr(route, "path", "unmatched"), str(status["code"])
            ).observe(time.perf_counter() - started)

    def _limit(self, scope: Scope) -> int:
        if scope["method"] == "POST" and scope["path"].rstrip("/") == "/v1/files":
            return self.max_upload_bytes
        return self.max_request_bytes

    def _refuse(self, scope: Scope) -> JSONResponse | None:
        headers = dict(scope["headers"])
        if self.token is not None and not dashboard.is_public_path(scope["path"]):
            auth = headers.get(b"authorization", b"")
            scheme, _, given = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.token):
                return _envelope(
                    401,
                    "authentication_error",
                    "invalid_token",
                    "missing or wrong bearer token: send 'Authorization: Bearer <RP_TOKEN>'",
                    headers={"www-authenticate": "Bearer"},
                )
        length = headers.get(b"content-length")
        limit = self._limit(scope)
        if length is not None and length.isdigit() and int(length) > limit:
            return _too_large(limit)
        return None

    def _counted(self, scope: Scope, receive: Receive) -> Receive:
        limit = self._limit(scope)
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _BodyTooLarge(413, f"the request body is over its limit of {limit} bytes")
            return message

        return counted


def _too_large(limit: int) -> JSONResponse:
    return _envelope(
        413,
        "request_too_large",
        "request_too_large",
        f"the request body is over its limit of {limit} bytes "
        "(RP_MAX_REQUEST_BYTES for JSON, RP_MAX_UPLOAD_BYTES for uploads)",
    )


def _param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header", "cookie"):
        parts = parts[1:]
    return ".".join(parts) or None


def _validation_response(exc: RequestValidationError) -> JSONResponse:
    details = []
    for err in exc.errors():
        message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if err.get("type") == "json_invalid":
            message = (
                f"the body is not valid JSON: {err.get('ctx', {}).get('error', 'decode error')}"
            )
            param = None
        else:
            param = _param(tuple(err.get("loc", ())))
        details.append({"param": param, "message": message})
    first = details[0] if details else {"param": None, "message": "invalid request"}
    text = f"{first['param']}: {first['message']}" if first["param"] else first["message"]
    if len(details) > 1:
        text += f" (and {len(details) - 1} more: see details)"
    return _envelope(
        422, "invalid_request_error", "invalid_value", text, param=first["param"], details=details
    )


def _install_error_handlers(app: FastAPI) -> None:
    """The one place where errors become HTTP responses, all in the envelope."""

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
        headers = {"x-should-retry": "false"} if exc.status_code == 409 else None
        if exc.status_code == 401:
            headers = {"www-authenticate": "Bearer"}
        retry_after_s = getattr(exc, "retry_after_s", None)  # e.g. serving.ServingBusy (503)
        if retry_after_s is not None:
            headers = {"retry-after": str(int(retry_after_s))}
        return JSONResponse(exc.envelope(), status_code=exc.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_, code = _HTTP_ERROR_TYPES.get(
            exc.status_code,
            ("server_error", "server_error")
            if exc.status_code >= 500
            else ("invalid_request_error", "bad_request"),
        )
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}; see /docs"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}; see /docs"
        return _envelope(exc.status_code, type_, code, message, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return _envelope(
            500, "server_error", "server_error", "internal error; see the daemon's log"
        )


def _openapi_with_bearer(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        schema.setdefault("components", {})["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"}
        }
        schema["security"] = [{"bearer": []}]
        app.openapi_schema = schema
    return app.openapi_schema


def create_app(settings: Settings) -> FastAPI:
    """Build the daemon's app; nothing starts until its lifespan runs."""
    store = Store(settings.db_path)
    hub = EventHub()
    orchestrator = Orchestrator(settings, store, hub)
    system = SystemProbe(
        probe_cuda=settings.gpus != "none",
        host_budget=lambda: orchestrator.resolver.host_budget_bytes,
    )
    services = Services(
        settings=settings,
        store=store,
        orchestrator=orchestrator,
        outputs=JobOutputs(settings, store, hub),
        files=FileService(store, settings.files_dir, max_upload_bytes=settings.max_upload_bytes),
        system=system,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(store.open)
        gpu_count = await asyncio.to_thread(system.cuda_device_count)
        await orchestrator.start(gpu_count=gpu_count)
        log.info(
            "rp_service %s ready: data in %s, GPUs %s",
            __version__,
            settings.data_dir,
            orchestrator.gpu_ids or "none",
        )
        try:
            yield
        finally:
            await orchestrator.stop()
            store.close()

    app = FastAPI(
        title="RoundPipe Service",
        version=__version__,
        description="Train LLMs far beyond GPU memory on one box; see docs/API.md.",
        lifespan=lifespan,
    )
    app.state.services = services
    registry, latency = build_registry(orchestrator)
    app.state.metrics_registry = registry
    _install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    app.include_router(openai_api.router)  # OpenAI's fine-tuning API (rp_service/api/openai)
    app.include_router(dashboard.router)
    app.add_middleware(_Guard, settings=settings, latency=latency)
    app.openapi = lambda: _openapi_with_bearer(app)  # type: ignore[method-assign]
    return app
