"""What both clients share, with no I/O: settings, headers, the retry policy, error mapping."""

from __future__ import annotations

import json
import os
import random
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from . import errors
from ._token import default_socket, default_token_file, read_token_file
from .models import JobSpec, load_spec_file

__all__ = ["DEFAULT_BASE_URL", "DEFAULT_TIMEOUT_S"]

DEFAULT_BASE_URL = "http://127.0.0.1:8321"
DEFAULT_TIMEOUT_S = 60.0
# The SSE `retry:` the daemon sends is 3000 ms; used until the stream says otherwise.
DEFAULT_RECONNECT_DELAY_S = 3.0

M = TypeVar("M", bound=BaseModel)

_STATUS_ERRORS: dict[int, type[errors.APIStatusError]] = {
    400: errors.ValidationError,
    401: errors.Unauthorized,
    404: errors.NotFound,
    409: errors.Conflict,
    413: errors.RequestTooLarge,
    422: errors.ValidationError,
    429: errors.TooManyRequests,
}

SpecLike = Mapping[str, Any] | JobSpec | str | os.PathLike[str]


class _BaseClient:
    """Settings and pure helpers shared by `Client` and `AsyncClient`."""

    def __init__(
        self,
        *,
        base_url: str | None,
        token: str | None,
        timeout_s: float,
        max_retries: int,
        retry_backoff_s: float,
        token_file: str | os.PathLike[str] | None = None,
    ) -> None:
        # Arguments win over the environment (RP_URL, RP_TOKEN), which wins over defaults;
        # the last default is the token file of a daemon on this machine (rp_client._token).
        self.base_url = (base_url or os.environ.get("RP_URL") or DEFAULT_BASE_URL).rstrip("/")
        # No URL given: the daemon of this machine, over its Unix socket when it has one.
        self.socket: Path | None = None
        if not base_url and not os.environ.get("RP_URL"):
            self.socket = default_socket()
        self.token = token if token is not None else (os.environ.get("RP_TOKEN") or None)
        self.token_file: Path | None = None
        if self.token is None:
            self.token_file = Path(token_file) if token_file else default_token_file(self.base_url)
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s

    def _default_headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "rp-client"}
        if self.token is None and self.token_file is not None:
            # Read when first needed: a daemon being started writes it a moment later.
            self.token = read_token_file(self.token_file)
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    @staticmethod
    def _is_retryable_request(request: httpx.Request) -> bool:
        """GETs, and job creation only when an Idempotency-Key makes a repeat harmless."""
        if request.method == "GET":
            return True
        return (
            request.method == "POST"
            and request.url.path.endswith("/v1/jobs")
            and "Idempotency-Key" in request.headers
        )

    @staticmethod
    def _is_retryable_response(response: httpx.Response) -> bool:
        if response.headers.get("x-should-retry", "").lower() == "false":
            return False
        return response.status_code == 503

    def _retry_delay_s(self, attempt: int, response: httpx.Response | None = None) -> float:
        """Exponential backoff with jitter; a 503's Retry-After (seconds) wins when given."""
        if response is not None:
            retry_after = response.headers.get("retry-after", "")
            try:
                return min(max(float(retry_after), 0.0), 60.0)
            except ValueError:
                pass
        base = self.retry_backoff_s * (2**attempt)
        return min(base, 30.0) * (0.75 + random.random() / 2)

    @property
    def where(self) -> str:
        """The daemon, as messages name it: its URL, or the socket used instead of it."""
        return f"unix socket {self.socket}" if self.socket is not None else self.base_url

    @staticmethod
    def _connection_error(exc: httpx.TransportError, base_url: str) -> errors.APIConnectionError:
        try:
            request: httpx.Request | None = exc.request
        except RuntimeError:  # httpx raises when no request is attached
            request = None
        if isinstance(exc, httpx.TimeoutException):
            return errors.APITimeoutError(
                f"the RoundPipe daemon at {base_url} did not answer in time "
                f"({type(exc).__name__}); try again, or raise timeout_s",
                request=request,
            )
        return errors.APIConnectionError(
            f"connection to the RoundPipe daemon at {base_url} failed: "
            f"{str(exc) or type(exc).__name__} (is it running? `rp serve` starts one; "
            "set RP_URL to point elsewhere)",
            request=request,
        )

    @staticmethod
    def _status_error(response: httpx.Response) -> errors.APIStatusError:
        """Maps a read 4xx/5xx response to the matching exception, with the server's words."""
        status = response.status_code
        cls = _STATUS_ERRORS.get(status)
        if cls is None:
            cls = errors.ServerError if status >= 500 else errors.APIStatusError
        envelope: dict[str, Any] = {}
        try:
            body = response.json()
            if isinstance(body, dict) and isinstance(body.get("error"), dict):
                envelope = body["error"]
            elif isinstance(body, dict) and "detail" in body:
                envelope = {
                    "message": body["detail"]
                    if isinstance(body["detail"], str)
                    else json.dumps(body["detail"])
                }
        except (ValueError, UnicodeDecodeError):
            pass
        message = envelope.get("message")
        if not isinstance(message, str) or not message:
            text = response.text.strip()[:300] if response.content else ""
            message = f"HTTP {status} {response.reason_phrase}" + (f": {text}" if text else "")
        param = envelope.get("param")
        details = envelope.get("details")
        # Naming the field helps for an invalid request; a 404's `param: job_id` does not.
        text = _compose_message(message, param if cls is errors.ValidationError else None, details)
        return cls(
            text,
            response=response,
            type=envelope.get("type"),
            code=envelope.get("code"),
            param=param,
            details=details,
        )

    @staticmethod
    def _spec_body(spec: SpecLike) -> dict[str, Any]:
        """The POST /v1/jobs body from a dict, a JobSpec, or a YAML/JSON file path."""
        if isinstance(spec, JobSpec):
            return spec.to_body()
        if isinstance(spec, Mapping):
            return dict(spec)
        if isinstance(spec, str | os.PathLike):
            path = Path(spec)
            if not path.is_file():
                raise FileNotFoundError(f"job spec file not found: {path}")
            return load_spec_file(path)
        raise TypeError(f"spec must be a dict, a JobSpec or a file path, got {type(spec).__name__}")

    @staticmethod
    def _new_idempotency_key() -> str:
        return f"rp-{uuid.uuid4().hex}"

    @staticmethod
    def _parse(model: type[M], response: httpx.Response) -> M:
        return model.model_validate(response.json())

    @staticmethod
    def _log_chunk(response: httpx.Response, offset: int) -> dict[str, Any]:
        next_offset = response.headers.get("x-next-offset")
        text = response.text
        return {
            "text": text,
            "next_offset": int(next_offset) if next_offset else offset + len(response.content),
        }

    @staticmethod
    def _next_cursor(page: Any, previous: Any) -> Any:
        """The `after` of the next page, or None when this page was the last."""
        if not page.has_more or not page.data:
            return None
        last = page.last_id if page.last_id is not None else getattr(page.data[-1], "id", None)
        # A server that ignores `after` would loop forever: stop instead.
        if last is None or last == previous:
            return None
        return last


def _compose_message(message: str, param: Any, details: Any) -> str:
    lines: list[str] = []
    if isinstance(details, list):
        for item in details:
            if isinstance(item, dict) and item.get("message"):
                p = item.get("param")
                lines.append(f"{p}: {item['message']}" if p else str(item["message"]))
    if len(lines) > 1:
        return "; ".join(lines)
    if param and str(param) not in message:
        return f"{param}: {message}"
    return message


def _q(value: str) -> str:
    """An id as one URL path segment."""
    return quote(str(value), safe="")


def _params(**values: Any) -> dict[str, Any]:
    """Query parameters without the ones left unset."""
    return {k: v for k, v in values.items() if v is not None}
