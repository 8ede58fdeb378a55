"""The service's error tree; `app.py` maps each class to one HTTP status in one handler."""

from __future__ import annotations

from typing import Any

__all__ = [
    "BadRequest",
    "Conflict",
    "DiskFull",
    "InvalidRequest",
    "NotFound",
    "NotReady",
    "RequestTooLarge",
    "ServiceError",
    "TooManyRequests",
    "Unauthorized",
]


class ServiceError(Exception):
    """Base of every error the service raises on purpose; rendered as the error envelope."""

    status_code = 500
    error_type = "server_error"
    default_code = "server_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        details: Any = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.param = param
        self.details = details

    def envelope(self) -> dict[str, Any]:
        return {
            "error": {
                "type": self.error_type,
                "code": self.code,
                "message": self.message,
                "param": self.param,
                "details": self.details,
            }
        }


class InvalidRequest(ServiceError):
    """A request is well-formed JSON but a value is not allowed (422)."""

    status_code = 422
    error_type = "invalid_request_error"
    default_code = "invalid_value"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        details: Any = None,
    ) -> None:
        if details is None and param is not None:
            details = [{"param": param, "message": message}]
        super().__init__(message, code=code, param=param, details=details)


class BadRequest(InvalidRequest):
    """A request the OpenAI-compatible API refuses (400, as OpenAI answers it)."""

    status_code = 400
    default_code = "invalid_request"


class Unauthorized(ServiceError):
    """The bearer token is missing or wrong (401)."""

    status_code = 401
    error_type = "authentication_error"
    default_code = "invalid_token"


class NotFound(ServiceError):
    """No such job, file or checkpoint (404)."""

    status_code = 404
    error_type = "not_found_error"
    default_code = "not_found"


class Conflict(ServiceError):
    """An illegal state transition or a reused idempotency key (409, never retry)."""

    status_code = 409
    error_type = "conflict_error"
    default_code = "conflict"


class RequestTooLarge(ServiceError):
    """A body or an upload is over its size limit (413)."""

    status_code = 413
    error_type = "request_too_large"
    default_code = "request_too_large"


class NotReady(ServiceError):
    """The daemon is starting or stopping (503)."""

    status_code = 503
    error_type = "server_error"
    default_code = "not_ready"


class TooManyRequests(ServiceError):
    """A limit of this daemon is reached (the queue, concurrent uploads): retry later (429)."""

    status_code = 429
    error_type = "rate_limit_error"
    default_code = "too_many_requests"


class DiskFull(ServiceError):
    """The data directory has less free space than RP_MIN_FREE_BYTES (507)."""

    status_code = 507
    error_type = "server_error"
    default_code = "disk_full"
