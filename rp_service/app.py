"""`create_app(settings)`: the FastAPI app, its lifespan, guard middleware and error handler."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
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
from rp_service.api.metrics import build_registry
from rp_service.datadir import DataDir
from rp_service.errors import (
    BODY_NOT_AN_OBJECT,
    InvalidRequest,
    JobFailure,
    ServiceError,
    body_is_not_an_object,
)
from rp_service.services import Services
from rp_service.settings import Settings, is_loopback

__all__ = ["create_app"]

log = logging.getLogger(__name__)

_UPLOAD_OVERHEAD_BYTES = 64 * 1024  # multipart boundaries and headers around the file
_HTTP_ERROR_TYPES = {
    400: ("invalid_request_error", "bad_request"),
    401: ("authentication_error", "invalid_token"),
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    409: ("conflict_error", "conflict"),
    403: ("permission_error", "forbidden"),
    413: ("request_too_large", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    429: ("rate_limit_error", "too_many_requests"),
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


class _BodyTooSlow(StarletteHTTPException):
    """Raised from inside `receive` past the body's deadline (see `_Guard._counted`)."""


# The request-latency histogram's labels come from fixed sets: a made-up method (anyone can
# send one, before auth) would otherwise add a series per request.
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})


@dataclass(slots=True)
class _AuthState:
    """The token the guard compares with; set by the lifespan (it may read the token file)."""

    required: bool
    token: bytes | None = None


def _host_name(value: str) -> str:
    """A Host header (or an Origin's netloc) without its port, lower case."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    name, sep, port = value.rpartition(":")
    return name if sep and port.isdigit() else value


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class _Guard:
    """Pure ASGI: Host and Origin checks, bearer token, body size limits, concurrent
    uploads, request latency. Streams stay streams."""

    def __init__(
        self, app: ASGIApp, *, settings: Settings, auth: _AuthState, latency: Histogram
    ) -> None:
        self.app = app
        self.auth = auth
        self.max_request_bytes = settings.max_request_bytes
        self.max_upload_bytes = settings.max_upload_bytes + _UPLOAD_OVERHEAD_BYTES
        self.max_uploads = settings.max_concurrent_uploads
        self.body_timeout_s = settings.body_timeout_s
        self.body_min_rate = settings.body_min_rate
        self.uploads = 0  # uploads in progress: only the event loop changes it
        self.any_host = "*" in settings.allowed_hosts
        # This machine's own names work without configuration; other DNS names (aliases)
        # go in RP_ALLOWED_HOSTS.
        self.hosts = {*settings.allowed_hosts, socket.gethostname().lower()}
        self.hosts.add(socket.getfqdn().lower())
        if settings.host.lower() not in _WILDCARD_HOSTS:
            self.hosts.add(_host_name(settings.host))
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

        upload = self._is_upload(scope)
        try:
            refusal = self._refuse(scope)
            if refusal is None and upload and self.uploads >= self.max_uploads:
                refusal = _envelope(
                    429,
                    "rate_limit_error",
                    "too_many_uploads",
                    f"{self.uploads} uploads are in progress, the most this daemon takes at "
                    "once (RP_MAX_CONCURRENT_UPLOADS); retry when one has finished",
                    headers={"retry-after": "5"},
                )
            if refusal is not None:
                await refusal(scope, receive, send_status)
                return
            if upload:
                self.uploads += 1
            try:
                await self.app(scope, self._counted(scope, receive), send_status)
            finally:
                if upload:
                    self.uploads -= 1
        finally:
            route = scope.get("route")
            method = scope["method"] if scope["method"] in _METHODS else "other"
            self.latency.labels(
                method, getattr(route, "path", "unmatched"), str(status["code"])
            ).observe(time.perf_counter() - started)

    @staticmethod
    def _is_upload(scope: Scope) -> bool:
        return scope["method"] == "POST" and scope["path"].rstrip("/") == "/v1/files"

    def _limit(self, scope: Scope) -> int:
        return self.max_upload_bytes if self._is_upload(scope) else self.max_request_bytes

    def _over(self, scope: Scope) -> str:
        """What a too-large body is over, quoting the setting's own value (an upload's limit
        here includes the multipart framing, which the setting does not)."""
        if self._is_upload(scope):
            setting = self.max_upload_bytes - _UPLOAD_OVERHEAD_BYTES
            return f"the upload is over RP_MAX_UPLOAD_BYTES={setting} bytes"
        return f"the request body is over RP_MAX_REQUEST_BYTES={self.max_request_bytes} bytes"

    def _host_allowed(self, host: bytes | None) -> bool:
        if host is None or self.any_host:  # no Host: not a browser, so no DNS rebinding
            return True
        name = _host_name(host.decode("latin-1"))
        # DNS rebinding needs a name the attacker controls: an address literal never is one.
        return is_loopback(name) or name in self.hosts or _is_address(name)

    def _refuse(self, scope: Scope) -> JSONResponse | None:
        headers = dict(scope["headers"])
        host = headers.get(b"host")
        if not self._host_allowed(host):
            shown = (host or b"").decode("latin-1")[:100]
            return _envelope(
                400,
                "invalid_request_error",
                "host_not_allowed",
                f"the Host header {shown!r} is not a name of this daemon: add it to "
                "RP_ALLOWED_HOSTS (loopback names are always allowed)",
            )
        origin = headers.get(b"origin")
        if origin is not None and scope["method"] in _STATE_CHANGING:
            netloc = origin.decode("latin-1").lower().partition("://")[2].rstrip("/")
            if not netloc or netloc != (host or b"").decode("latin-1").lower():
                return _envelope(
                    403,
                    "permission_error",
                    "cross_origin_refused",
                    f"a {scope['method']} from the page of another site "
                    f"({origin.decode('latin-1')[:100]!r}) is refused; call the API from a "
                    "client, or from the daemon's own dashboard",
                )
        if self.auth.required and not dashboard.is_public_path(scope["path"]):
            auth = headers.get(b"authorization", b"")
            scheme, _, given = auth.partition(b" ")
            token = self.auth.token
            if (
                token is None
                or scheme.lower() != b"bearer"
                or not hmac.compare_digest(given.strip(), token)
            ):
                return _envelope(
                    401,
                    "authentication_error",
                    "invalid_token",
                    "missing or wrong bearer token: send 'Authorization: Bearer <token>' "
                    "(RP_TOKEN, or the daemon's $RP_DATA_DIR/token file)",
                    headers={"www-authenticate": "Bearer"},
                )
        length = headers.get(b"content-length")
        limit = self._limit(scope)
        if length is not None and length.isdigit() and int(length) > limit:
            return _too_large(self._over(scope))
        return None

    def _counted(self, scope: Scope, receive: Receive) -> Receive:
        """`receive` with the body's size limit and its deadline: RP_BODY_TIMEOUT_S, plus
        1 s per RP_BODY_MIN_RATE bytes received, from the first read (as Apache's
        mod_reqtimeout). Once the body is complete, reads (waits for a disconnect) pass."""
        limit = self._limit(scope)
        seen = 0
        complete = False
        started: float | None = None

        async def counted() -> Message:
            nonlocal seen, complete, started
            if complete:
                return await receive()
            loop = asyncio.get_running_loop()
            if started is None:
                started = loop.time()
            due = started + self.body_timeout_s + seen / self.body_min_rate
            try:
                async with asyncio.timeout_at(due):
                    message = await receive()
            except TimeoutError:
                raise self._too_slow(scope, seen, loop.time() - started) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if seen > limit:
                    raise _BodyTooLarge(413, self._over(scope))
            else:
                complete = True  # a disconnect: nothing more will come
            return message

        return counted

    def _too_slow(self, scope: Scope, seen: int, waited_s: float) -> _BodyTooSlow:
        client = scope.get("client")
        log.warning(
            "request body of %s %s from %s arrived too slowly (%d bytes in %.1f s): "
            "answered 408 and closed",
            scope["method"],
            scope["path"],
            client[0] if client else "the unix socket",
            seen,
            waited_s,
        )
        return _BodyTooSlow(
            408,
            f"the request body arrived too slowly ({seen} bytes in {waited_s:.1f} s): a body "
            f"must arrive within RP_BODY_TIMEOUT_S={self.body_timeout_s:g} s plus 1 s per "
            f"RP_BODY_MIN_RATE={self.body_min_rate} bytes",
            headers={"connection": "close"},
        )


def _too_large(message: str) -> JSONResponse:
    return _envelope(413, "request_too_large", "request_too_large", message)


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
        elif body_is_not_an_object(err):
            message, param = BODY_NOT_AN_OBJECT, None
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
        elif exc.status_code == 429:
            headers = {"retry-after": "5"}
        retry_after_s = getattr(exc, "retry_after_s", None)  # e.g. serving.ServingBusy (503)
        if retry_after_s is not None:
            headers = {"retry-after": str(int(retry_after_s))}
        return JSONResponse(exc.envelope(), status_code=exc.status_code, headers=headers)

    @app.exception_handler(JobFailure)
    async def _job_failure(request: Request, exc: JobFailure) -> JSONResponse:
        # A spec this daemon cannot run, found at submission: InvalidRequest's 422, with
        # the failure's figures beside its field in the details.
        details = (
            [{"param": exc.param, "message": exc.message, **exc.details}]
            if exc.param is not None
            else exc.details or None
        )
        refusal = InvalidRequest(exc.message, code=exc.code, param=exc.param, details=details)
        return JSONResponse(refusal.envelope(), status_code=refusal.status_code)

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
            message = f"no route {request.method} {request.url.path}; see /docs (the API reference)"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}; see /docs (the API reference)"
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


def create_app(settings: Settings, *, data_dir: DataDir | None = None) -> FastAPI:
    """Build the daemon's app; nothing starts until its lifespan runs.

    The lifespan claims the data directory (lock, modes; see rp_service.datadir) unless
    `data_dir` comes already claimed (`python -m rp_service` claims it before uvicorn).
    """
    data = data_dir if data_dir is not None else DataDir(settings.data_dir)
    services = Services.build(settings)
    auth = _AuthState(required=settings.auth == "token")
    if settings.token is not None:
        auth.token = settings.token.get_secret_value().encode()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        claimed_here = not data.held
        if claimed_here:
            await asyncio.to_thread(data.claim)
        try:
            if auth.required and auth.token is None:
                auth.token = (await asyncio.to_thread(data.token)).encode()
                log.info("bearer token: in %s (clients on this machine read it)", data.token_path)
            await services.start()
            log.info(
                "rp_service %s ready: data in %s, GPUs %s",
                __version__,
                settings.data_dir,
                services.orchestrator.gpu_ids or "none",
            )
            try:
                yield
            finally:
                await services.close()
        finally:
            if claimed_here:
                data.release()

    app = FastAPI(
        title="RoundPipe Service",
        version=__version__,
        description="Train LLMs far beyond GPU memory on one box; see docs/API.md.",
        lifespan=lifespan,
        # /docs is the dashboard's API view (api/dashboard.py): no CDN, the page's token
        docs_url=None,
        redoc_url=None,
    )
    app.state.services = services
    registry, latency = build_registry(services.orchestrator)
    app.state.metrics_registry = registry
    _install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    app.include_router(openai_api.router)  # OpenAI's fine-tuning API (rp_service/api/openai)
    app.include_router(dashboard.router)
    app.add_middleware(_Guard, settings=settings, auth=auth, latency=latency)
    app.openapi = lambda: _openapi_with_bearer(app)  # type: ignore[method-assign]
    return app
