"""The service's error trees; `app.py` maps each class to one HTTP status in one handler.

`ServiceError` and its subclasses are the API's refusals, each with its HTTP status.
`JobFailure` and its subclasses say a job cannot run as specified (`code`, and `param`, the
JobSpec field to change): domain errors without HTTP, raised alike at submission (where
`app.py` answers them with a 422) and in the worker (where they become the job's error
event).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BODY_NOT_AN_OBJECT",
    "BadRequest",
    "Conflict",
    "DiskFull",
    "HostMemoryExceeded",
    "InvalidRequest",
    "JobFailure",
    "NotFound",
    "NotReady",
    "RequestTooLarge",
    "ServiceError",
    "TooManyRequests",
    "Unauthorized",
    "body_is_not_an_object",
]

BODY_NOT_AN_OBJECT = (
    "the body must be a JSON object; send it as JSON with the header Content-Type: application/json"
)


def body_is_not_an_object(error: dict[str, Any]) -> bool:
    """Whether a request validation error says the whole body is no mapping (a form-encoded
    body, curl -d without a content type; a JSON list)."""
    kinds = ("model_attributes_type", "model_type", "dict_type")
    return tuple(error.get("loc", ())) == ("body",) and error.get("type") in kinds


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


class JobFailure(Exception):
    """A job cannot run as specified; `param` names the JobSpec field to change.

    Attributes:
        code: What went wrong, for machines (``invalid_data``, ``host_memory_exceeded``).
        message: What went wrong and what to do, for people.
        param: The dotted JobSpec field to change; None when no one field is to blame.
        details: Figures behind the cause (JSON values), added to the error event.
    """

    def __init__(
        self, code: str, message: str, *, param: str | None = None, **details: Any
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.details = details


class HostMemoryExceeded(JobFailure):
    """The host-memory plan of a job is over the budget; `details` has the figures
    (need_bytes, budget_bytes, parts_bytes) and the options that would fit."""

    def __init__(self, message: str, *, param: str, **details: Any) -> None:
        super().__init__("host_memory_exceeded", message, param=param, **details)


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
