"""Exceptions raised by the SDK; each carries the server's message."""

from __future__ import annotations

from typing import Any

import httpx

__all__ = [
    "APIConnectionError",
    "APIError",
    "APIStatusError",
    "APITimeoutError",
    "Conflict",
    "NotFound",
    "RequestTooLarge",
    "ServerError",
    "TooManyRequests",
    "Unauthorized",
    "ValidationError",
]


class APIError(Exception):
    """Base of every error the SDK raises on purpose."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class APIConnectionError(APIError):
    """The daemon could not be reached (refused, reset, DNS), even after retries."""

    def __init__(self, message: str, *, request: httpx.Request | None = None) -> None:
        super().__init__(message)
        self.request = request


class APITimeoutError(APIConnectionError):
    """The daemon did not answer in time."""


class APIStatusError(APIError):
    """The daemon answered with a 4xx or 5xx; the fields mirror its error envelope.

    Attributes:
        response: the `httpx.Response` (its body already read).
        status_code: the HTTP status.
        type: the envelope's `type` (e.g. `not_found_error`), or None.
        code: the envelope's `code`, or None.
        param: the dotted field the error is about (e.g. `train.lr`), or None.
        details: the envelope's `details` (for 422: a list of `{"param", "message"}`).
    """

    def __init__(
        self,
        message: str,
        *,
        response: httpx.Response,
        type: str | None = None,
        code: str | None = None,
        param: str | None = None,
        details: Any = None,
    ) -> None:
        super().__init__(message)
        self.response = response
        self.status_code = response.status_code
        self.type = type
        self.code = code
        self.param = param
        self.details = details


class ValidationError(APIStatusError):
    """400 or 422: the request (a job spec, an upload) is invalid.

    `errors` lists each field's problem as `{"param", "message"}`.
    """

    @property
    def errors(self) -> list[dict[str, Any]]:
        if isinstance(self.details, list):
            return [d for d in self.details if isinstance(d, dict)]
        if self.param or self.message:
            return [{"param": self.param, "message": self.message}]
        return []


class Unauthorized(APIStatusError):
    """401: the token is missing or wrong (set `token=` or `RP_TOKEN`)."""


class NotFound(APIStatusError):
    """404: no such job, file or checkpoint."""


class Conflict(APIStatusError):
    """409: an illegal state transition, or an Idempotency-Key reused with another body."""


class RequestTooLarge(APIStatusError):
    """413: the upload or request body is over the daemon's limit."""


class TooManyRequests(APIStatusError):
    """429: a limit of the daemon is reached (its queue, concurrent uploads); retry later."""


class ServerError(APIStatusError):
    """5xx: the daemon failed; `message` says what it knows."""
