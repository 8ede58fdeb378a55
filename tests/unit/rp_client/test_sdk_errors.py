"""Status codes map to exceptions carrying the server's words; the retry policy."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from rp_client import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    Conflict,
    NotFound,
    RequestTooLarge,
    ServerError,
    Unauthorized,
    ValidationError,
)

from ._fakes import error_response, job_obj


@pytest.mark.parametrize(
    ("status", "type_", "cls"),
    [
        (400, "invalid_request_error", ValidationError),
        (401, "authentication_error", Unauthorized),
        (404, "not_found_error", NotFound),
        (409, "conflict_error", Conflict),
        (413, "request_too_large", RequestTooLarge),
        (422, "invalid_request_error", ValidationError),
        (500, "server_error", ServerError),
        (503, "server_error", ServerError),
        (418, "teapot", APIStatusError),
    ],
)
def test_status_maps_to_exception(make_client, status, type_, cls):
    client, _ = make_client(
        lambda r: error_response(status, type_, "what went wrong", param="train.lr"),
        max_retries=0,
    )
    with pytest.raises(cls) as info:
        client.jobs.get("job-1")
    err = info.value
    assert type(err) is cls
    assert err.status_code == status and err.type == type_ and err.param == "train.lr"
    if cls is ValidationError:
        assert str(err) == "train.lr: what went wrong"
    else:
        assert str(err) == "what went wrong"
    assert err.response.status_code == status


def test_validation_error_lists_every_field(make_client):
    details = [
        {"param": "train.lr", "message": "must be > 0"},
        {"param": "data.train", "message": "line 17: not JSON"},
    ]
    client, _ = make_client(
        lambda r: error_response(
            422, "invalid_request_error", "must be > 0", param="train.lr", details=details
        )
    )
    with pytest.raises(ValidationError) as info:
        client.jobs.create({"train": {"lr": -1}})
    assert info.value.errors == details
    assert str(info.value) == "train.lr: must be > 0; data.train: line 17: not JSON"


def test_error_without_envelope_still_says_something(make_client):
    client, _ = make_client(lambda r: httpx.Response(502, text="<html>bad gateway</html>"))
    with pytest.raises(ServerError, match="HTTP 502 Bad Gateway: <html>bad gateway</html>"):
        client.jobs.get("job-1")


def test_get_retries_503_then_succeeds(make_client):
    answers = iter(
        [
            error_response(503, "server_error", "starting"),
            error_response(503, "server_error", "starting"),
            httpx.Response(200, json=job_obj()),
        ]
    )
    client, rec = make_client(lambda r: next(answers))
    assert client.jobs.get("job-1").id == "job-1"
    assert len(rec.requests) == 3


def test_retries_give_up_after_max_retries(make_client):
    client, rec = make_client(lambda r: error_response(503, "server_error", "busy"), max_retries=2)
    with pytest.raises(ServerError, match="busy"):
        client.jobs.get("job-1")
    assert len(rec.requests) == 3


def test_get_retries_connection_errors(make_client):
    calls = {"n": 0}

    def handler(request):
        calls["n"] += 1
        if calls["n"] < 3:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json=job_obj())

    client, _ = make_client(handler)
    assert client.jobs.get("job-1").id == "job-1"
    assert calls["n"] == 3


def test_connection_error_after_retries_names_the_daemon(make_client):
    def handler(request):
        raise httpx.ConnectError("refused", request=request)

    client, rec = make_client(handler, max_retries=1)
    with pytest.raises(APIConnectionError, match=r"http://rp\.test") as info:
        client.jobs.get("job-1")
    assert not isinstance(info.value, APIStatusError)
    assert len(rec.requests) == 2


def test_timeout_maps_to_api_timeout_error(make_client):
    def handler(request):
        raise httpx.ReadTimeout("slow", request=request)

    client, _ = make_client(handler, max_retries=0)
    with pytest.raises(APITimeoutError):
        client.jobs.get("job-1")


def test_create_with_idempotency_key_is_retried(make_client):
    answers = iter(
        [error_response(503, "server_error", "busy"), httpx.Response(201, json=job_obj())]
    )
    client, rec = make_client(lambda r: next(answers))
    client.jobs.create({"train": {"steps": 1}}, idempotency_key="k1")
    assert [r.headers["Idempotency-Key"] for r in rec.requests] == ["k1", "k1"]


@pytest.mark.parametrize("action", ["cancel", "pause", "resume"])
def test_non_idempotent_posts_are_never_retried(make_client, action):
    def handler(request):
        raise httpx.ConnectError("refused", request=request)

    client, rec = make_client(handler)
    with pytest.raises(APIConnectionError):
        getattr(client.jobs, action)("job-1")
    assert len(rec.requests) == 1


def test_upload_and_delete_are_never_retried(make_client):
    client, rec = make_client(lambda r: error_response(503, "server_error", "busy"))
    with pytest.raises(ServerError):
        client.files.upload(("a.jsonl", b"{}\n"))
    with pytest.raises(ServerError):
        client.files.delete("file-1")
    assert len(rec.requests) == 2


def test_409_is_not_retried_and_x_should_retry_false_is_respected(make_client):
    client, rec = make_client(
        lambda r: error_response(503, "server_error", "no", headers={"x-should-retry": "false"})
    )
    with pytest.raises(ServerError):
        client.jobs.get("job-1")
    assert len(rec.requests) == 1
    client, rec = make_client(lambda r: error_response(409, "conflict_error", "job is succeeded"))
    with pytest.raises(Conflict, match="job is succeeded"):
        client.jobs.cancel("job-1")
    assert len(rec.requests) == 1


def test_backoff_grows_and_honours_retry_after(make_client):
    client, _ = make_client(lambda r: httpx.Response(200), retry_backoff_s=0.5)
    delays = [client._retry_delay_s(n) for n in range(4)]
    for n, delay in enumerate(delays):
        assert 0.5 * 2**n * 0.75 <= delay <= 0.5 * 2**n * 1.25
    response = httpx.Response(503, headers={"retry-after": "2"})
    assert client._retry_delay_s(0, response) == 2.0


def test_async_errors_and_retries(make_async_client):
    answers = iter(
        [
            error_response(503, "server_error", "starting"),
            error_response(404, "not_found_error", "no job job-9"),
        ]
    )
    client, rec = make_async_client(lambda r: next(answers))

    async def main():
        async with client:
            await client.jobs.get("job-9")

    with pytest.raises(NotFound, match="no job job-9"):
        asyncio.run(main())
    assert len(rec.requests) == 2
