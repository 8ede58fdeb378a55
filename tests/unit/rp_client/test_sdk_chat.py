"""`client.chat` (sync and async) and `rp chat` over a MockTransport daemon."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from rp_client import APIError, ChatReply, NotFound
from rp_client.cli import app
from typer.testing import CliRunner

from ._fakes import error_response

MODEL = "ft:tiny:job-1"


def _completion(content: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "refusal": None},
                "logprobs": None,
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }


def _chunk(delta: dict[str, Any], finish: str | None = None) -> str:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    body = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    return "data: " + json.dumps({**body, "choices": [choice]}) + "\n\n"


def _sse(*pieces: str, error: str | None = None) -> bytes:
    parts = [_chunk({"role": "assistant", "content": "", "refusal": None})]
    parts += [_chunk({"content": p}) for p in pieces]
    if error is not None:
        parts.append("data: " + json.dumps({"error": {"message": error}}) + "\n\n")
    else:
        parts += [_chunk({}, "stop"), "data: [DONE]\n\n"]
    return "".join(parts).encode()


def _handler(pieces: list[str], *, error: str | None = None):
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body["model"] == "missing":
            return error_response(404, "not_found_error", "the model 'missing' does not exist")
        if body.get("stream"):
            return httpx.Response(
                200,
                content=_sse(*pieces, error=error),
                headers={"content-type": "text/event-stream"},
            )
        return httpx.Response(200, json=_completion("".join(pieces)))

    return handle


def test_chat_sends_openai_parameters_and_returns_the_reply(make_client) -> None:
    client, rec = make_client(_handler(["4", "2", "!"]))
    reply = client.chat(MODEL, "hi", max_tokens=3, temperature=0, stop=["\n"])
    assert isinstance(reply, ChatReply)
    assert (reply.content, reply.finish_reason, reply.usage.total_tokens) == ("42!", "length", 8)
    sent = json.loads(rec.requests[0].content)
    assert sent == {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 3,
        "temperature": 0,
        "stop": ["\n"],
    }
    assert rec.requests[0].url.path == "/v1/chat/completions"


def test_stream_yields_the_text_pieces(make_client) -> None:
    client, rec = make_client(_handler(["Hel", "lo", " you"]))
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert list(client.chat.stream(MODEL, messages)) == ["Hel", "lo", " you"]
    assert json.loads(rec.requests[0].content)["stream"] is True


def test_an_error_inside_the_stream_raises(make_client) -> None:
    client, _ = make_client(_handler(["a"], error="the serving process exited"))
    with pytest.raises(APIError, match="serving process exited"):
        list(client.chat.stream(MODEL, "x"))


def test_unknown_model_is_not_found(make_client) -> None:
    client, _ = make_client(_handler([]), max_retries=0)
    with pytest.raises(NotFound):
        client.chat("missing", "x")


def test_async_twins(make_async_client) -> None:
    async def run() -> tuple[str, list[str]]:
        client, _ = make_async_client(_handler(["x", "y"]))
        async with client:
            reply = await client.chat(MODEL, "hi")
            pieces = [p async for p in client.chat.stream(MODEL, "hi")]
        return reply.content, pieces

    assert asyncio.run(run()) == ("xy", ["x", "y"])


def _rp(make_client, handler, *args: str, **kwargs: Any) -> Any:
    client, rec = make_client(handler, max_retries=0)
    result = CliRunner().invoke(app, list(args), obj={"client": client}, **kwargs)
    result.requests = rec.requests
    return result


def test_rp_chat_prompt_prints_one_answer(make_client) -> None:
    result = _rp(make_client, _handler(["Hi", " there"]), "chat", "job-1", "--prompt", "hello")
    assert result.exit_code == 0, result.output
    assert result.stdout == "Hi there\n"
    sent = json.loads(result.requests[0].content)
    assert sent["model"] == "job-1" and sent["messages"] == [{"role": "user", "content": "hello"}]


def test_rp_chat_keeps_the_conversation(make_client) -> None:
    handler = _handler(["ok"])
    result = _rp(
        make_client, handler, "chat", MODEL, "--system", "be brief", input="one\n\ntwo\n/quit\n"
    )
    assert result.exit_code == 0, result.output
    assert result.stdout == "ok\nok\n" and len(result.requests) == 2
    assert json.loads(result.requests[1].content)["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "two"},
    ]


def test_rp_chat_unknown_model_is_a_usage_error(make_client) -> None:
    result = _rp(make_client, _handler([]), "chat", "missing", "-p", "x")
    assert result.exit_code == 2 and "does not exist" in result.stderr
