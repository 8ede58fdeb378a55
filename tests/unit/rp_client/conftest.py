"""Clients wired to `httpx.MockTransport` handlers, for SDK and CLI unit tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from ._fakes import BASE, Recorder

from rp_client import AsyncClient, Client  # isort: skip  (client/ is put on sys.path above)


@pytest.fixture
def make_client() -> Callable[..., tuple[Client, Recorder]]:
    made: list[Client] = []

    def make(handler: Callable[[httpx.Request], httpx.Response], **kwargs: Any):
        recorder = Recorder(handler)
        kwargs.setdefault("retry_backoff_s", 0.0)
        client = Client(
            BASE, http_client=httpx.Client(transport=httpx.MockTransport(recorder)), **kwargs
        )
        made.append(client)
        return client, recorder

    yield make
    for client in made:
        client.close()


@pytest.fixture
def make_async_client() -> Callable[..., tuple[AsyncClient, Recorder]]:
    def make(handler: Callable[[httpx.Request], httpx.Response], **kwargs: Any):
        recorder = Recorder(handler)
        kwargs.setdefault("retry_backoff_s", 0.0)
        client = AsyncClient(
            BASE, http_client=httpx.AsyncClient(transport=httpx.MockTransport(recorder)), **kwargs
        )
        return client, recorder

    return make
