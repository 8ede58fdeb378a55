"""`Client` and `AsyncClient`: the same calls, the second one awaited."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import httpx

from ._base import DEFAULT_TIMEOUT_S, _BaseClient
from ._chat import AsyncChat, Chat
from ._files import AsyncCheckpoints, AsyncFiles, Checkpoints, Files
from ._jobs import AsyncJobs, Jobs
from .models import System

__all__ = ["AsyncClient", "Client"]

log = logging.getLogger(__name__)


class Client(_BaseClient):
    """Talks to a RoundPipe daemon.

    Args:
        base_url: e.g. `http://gpu-box:8321`; default `RP_URL`, else http://127.0.0.1:8321.
        token: the bearer token; default `RP_TOKEN`, else for a daemon on this machine
            (a loopback URL) the token file it wrote: `token_file`, default
            `$RP_DATA_DIR/token` (./rp-data/token).
        token_file: where to read the token when none is given.
        timeout_s: per request; an event stream reconnects after 60 s without a byte (the
            daemon pings every 15 s), a log stream waits as long as it needs.
        max_retries: retries of idempotent calls on connection errors and 503.
        retry_backoff_s: first backoff; doubles each retry, with jitter.
        http_client: an `httpx.Client` to use (its transport, proxies); closed by `close()`.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_retries: int = 3,
        retry_backoff_s: float = 0.5,
        http_client: httpx.Client | None = None,
    ) -> None:
        super().__init__(
            base_url=base_url,
            token=token,
            token_file=token_file,
            timeout_s=timeout_s,
            max_retries=max_retries,
            retry_backoff_s=retry_backoff_s,
        )
        if http_client is not None:
            self.socket = None  # the caller's client decides how to connect
        uds = httpx.HTTPTransport(uds=str(self.socket)) if self.socket is not None else None
        self._http = http_client or httpx.Client(timeout=timeout_s, transport=uds)
        self.jobs = Jobs(self)
        self.files = Files(self)
        self.checkpoints = Checkpoints(self)
        self.chat = Chat(self)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _send(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        json: Any = None,
        headers: dict[str, str] | None = None,
        files: Any = None,
        data: Any = None,
        stream: bool = False,
        retries: int | None = None,
        timeout: Any = None,
    ) -> httpx.Response:
        """Sends a request, retrying idempotent ones; raises the mapped error on 4xx/5xx."""
        request = self._http.build_request(
            method,
            self.base_url + path,
            params=params,
            json=json,
            headers={**self._default_headers(), **(headers or {})},
            files=files,
            data=data,
            timeout=timeout if timeout is not None else self.timeout_s,
        )
        retryable = self._is_retryable_request(request)
        max_retries = self.max_retries if retries is None else retries
        attempt = 0
        while True:
            try:
                response = self._http.send(request, stream=stream)
            except httpx.TransportError as exc:
                if retryable and attempt < max_retries:
                    log.info("%s %s failed (%s); retry %d", method, path, exc, attempt + 1)
                    time.sleep(self._retry_delay_s(attempt))
                    attempt += 1
                    continue
                raise self._connection_error(exc, self.where) from exc
            if response.is_success:
                return response
            response.read()
            response.close()
            if retryable and attempt < max_retries and self._is_retryable_response(response):
                log.info("%s %s: %d; retry %d", method, path, response.status_code, attempt + 1)
                time.sleep(self._retry_delay_s(attempt, response))
                attempt += 1
                continue
            raise self._status_error(response)

    @contextmanager
    def _stream(self, method: str, path: str, **kwargs: Any) -> Iterator[httpx.Response]:
        response = self._send(method, path, stream=True, **kwargs)
        try:
            yield response
        finally:
            response.close()

    def system(self) -> System:
        """Versions, devices, memory, the C Adam build, queue length and job counts."""
        return self._parse(System, self._send("GET", "/v1/system"))

    def demo_spec(self) -> dict[str, Any]:
        """The embedded demo JobSpec (what `rp demo` submits)."""
        return self._send("GET", "/v1/demo").json()

    def health(self) -> dict[str, Any]:
        """GET /healthz (liveness; needs no token)."""
        return self._send("GET", "/healthz", retries=0).json()

    def ready(self) -> dict[str, Any]:
        """GET /readyz; raises `ServerError` (503) while the daemon is starting."""
        return self._send("GET", "/readyz", retries=0).json()


class AsyncClient(_BaseClient):
    """`Client`, awaited: the same arguments and the same calls."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_retries: int = 3,
        retry_backoff_s: float = 0.5,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(
            base_url=base_url,
            token=token,
            token_file=token_file,
            timeout_s=timeout_s,
            max_retries=max_retries,
            retry_backoff_s=retry_backoff_s,
        )
        if http_client is not None:
            self.socket = None  # the caller's client decides how to connect
        uds = httpx.AsyncHTTPTransport(uds=str(self.socket)) if self.socket is not None else None
        self._http = http_client or httpx.AsyncClient(timeout=timeout_s, transport=uds)
        self.jobs = AsyncJobs(self)
        self.files = AsyncFiles(self)
        self.checkpoints = AsyncCheckpoints(self)
        self.chat = AsyncChat(self)

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _send(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        json: Any = None,
        headers: dict[str, str] | None = None,
        files: Any = None,
        data: Any = None,
        stream: bool = False,
        retries: int | None = None,
        timeout: Any = None,
    ) -> httpx.Response:
        """Sends a request, retrying idempotent ones; raises the mapped error on 4xx/5xx."""
        request = self._http.build_request(
            method,
            self.base_url + path,
            params=params,
            json=json,
            headers={**self._default_headers(), **(headers or {})},
            files=files,
            data=data,
            timeout=timeout if timeout is not None else self.timeout_s,
        )
        retryable = self._is_retryable_request(request)
        max_retries = self.max_retries if retries is None else retries
        attempt = 0
        while True:
            try:
                response = await self._http.send(request, stream=stream)
            except httpx.TransportError as exc:
                if retryable and attempt < max_retries:
                    log.info("%s %s failed (%s); retry %d", method, path, exc, attempt + 1)
                    await asyncio.sleep(self._retry_delay_s(attempt))
                    attempt += 1
                    continue
                raise self._connection_error(exc, self.where) from exc
            if response.is_success:
                return response
            await response.aread()
            await response.aclose()
            if retryable and attempt < max_retries and self._is_retryable_response(response):
                log.info("%s %s: %d; retry %d", method, path, response.status_code, attempt + 1)
                await asyncio.sleep(self._retry_delay_s(attempt, response))
                attempt += 1
                continue
            raise self._status_error(response)

    @asynccontextmanager
    async def _stream(self, method: str, path: str, **kwargs: Any) -> AsyncIterator[httpx.Response]:
        response = await self._send(method, path, stream=True, **kwargs)
        try:
            yield response
        finally:
            await response.aclose()

    async def system(self) -> System:
        """Versions, devices, memory, the C Adam build, queue length and job counts."""
        return self._parse(System, await self._send("GET", "/v1/system"))

    async def demo_spec(self) -> dict[str, Any]:
        """The embedded demo JobSpec (what `rp demo` submits)."""
        return (await self._send("GET", "/v1/demo")).json()

    async def health(self) -> dict[str, Any]:
        """GET /healthz (liveness; needs no token)."""
        return (await self._send("GET", "/healthz", retries=0)).json()

    async def ready(self) -> dict[str, Any]:
        """GET /readyz; raises `ServerError` (503) while the daemon is starting."""
        return (await self._send("GET", "/readyz", retries=0)).json()
