"""`client.chat`: ask a trained model (sync and async twins over `/v1/chat/completions`).

`client.chat(model, "question")` returns a `ChatReply`; `client.chat.stream(...)` yields
the answer's text as the model writes it. `model` is a model id (`ft:<base>:<job-id>`, a
base folder's name) or a job id. `messages` is a string (one user message) or OpenAI's
list of `{"role", "content"}` dicts.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import httpx
from pydantic import BaseModel, ConfigDict

from . import errors

if TYPE_CHECKING:
    from ._client import AsyncClient, Client

__all__ = ["AsyncChat", "Chat", "ChatReply", "ChatUsage"]

Messages = str | Sequence[dict[str, Any]]
_DONE = "[DONE]"


class ChatUsage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatReply(BaseModel):
    """One answer: its text, why it ended (`stop` or `length`) and the tokens counted."""

    model_config = ConfigDict(extra="ignore")

    id: str
    model: str
    content: str
    finish_reason: str
    usage: ChatUsage


def _body(
    model: str,
    messages: Messages,
    *,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    seed: int | None,
    stop: str | list[str] | None,
    stream: bool,
) -> dict[str, Any]:
    """The request body (pure)."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    body: dict[str, Any] = {"model": model, "messages": list(messages)}
    options = {
        "max_completion_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
        "stop": stop,
    }
    body.update({k: v for k, v in options.items() if v is not None})
    if stream:
        body["stream"] = True
    return body


def _reply(data: dict[str, Any]) -> ChatReply:
    choice = data["choices"][0]
    return ChatReply(
        id=data["id"],
        model=data["model"],
        content=choice["message"]["content"],
        finish_reason=choice["finish_reason"],
        usage=ChatUsage.model_validate(data["usage"]),
    )


def _piece(line: str) -> str | None:
    """The text of one server-sent line; None for lines without text. Raises `APIError`
    for an error sent inside the stream (the model failed after the answer began)."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    if data == _DONE:
        return None
    chunk = json.loads(data)
    if "error" in chunk:
        raise errors.APIError(str(chunk["error"].get("message", "generation failed")))
    choices = chunk.get("choices") or []
    return (choices[0].get("delta") or {}).get("content") or None if choices else None


def _answer_timeout(client: Any) -> httpx.Timeout:
    # A cold model loads before its first token (the daemon gives up after
    # RP_SERVE_LOAD_TIMEOUT_S): no read timeout on the answer, the client's on the rest.
    return httpx.Timeout(client.timeout_s, read=None)


class Chat:
    """`client.chat(...)`: one answer; `client.chat.stream(...)`: its text as it comes."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def __call__(
        self,
        model: str,
        messages: Messages,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: str | list[str] | None = None,
    ) -> ChatReply:
        body = _body(
            model,
            messages,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=stop,
            stream=False,
        )
        response = self._client._send(
            "POST", "/v1/chat/completions", json=body, timeout=_answer_timeout(self._client)
        )
        return _reply(response.json())

    def stream(
        self,
        model: str,
        messages: Messages,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: str | list[str] | None = None,
    ) -> Iterator[str]:
        body = _body(
            model,
            messages,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=stop,
            stream=True,
        )
        with self._client._stream(
            "POST", "/v1/chat/completions", json=body, timeout=_answer_timeout(self._client)
        ) as response:
            for line in response.iter_lines():
                piece = _piece(line)
                if piece:
                    yield piece


class AsyncChat:
    """`Chat`, awaited."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def __call__(
        self,
        model: str,
        messages: Messages,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: str | list[str] | None = None,
    ) -> ChatReply:
        body = _body(
            model,
            messages,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=stop,
            stream=False,
        )
        response = await self._client._send(
            "POST", "/v1/chat/completions", json=body, timeout=_answer_timeout(self._client)
        )
        return _reply(response.json())

    async def stream(
        self,
        model: str,
        messages: Messages,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: str | list[str] | None = None,
    ) -> AsyncIterator[str]:
        body = _body(
            model,
            messages,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=stop,
            stream=True,
        )
        async with self._client._stream(
            "POST", "/v1/chat/completions", json=body, timeout=_answer_timeout(self._client)
        ) as response:
            async for line in response.aiter_lines():
                piece = _piece(line)
                if piece:
                    yield piece
