"""The chat service behind OpenAI's `/v1/chat/completions` and `/v1/models`: resolves the
model, asks the serving process, and shapes its replies as `chat.completion` objects or
as the server-sent `chat.completion.chunk`s OpenAI streams, ending in `data: [DONE]`.

A stream is opened before the response starts (`Chat.open`: the model is resolved, its
process started, the prompt rendered and counted), so an unknown model, a busy GPU or a
missing chat template is an ordinary error response, never a broken stream.

A request is cancelled when its client disconnects (`gone`), while it waits behind others
in its process's queue and while a whole answer (no stream) is written: the serving
process drops or stops it, so the next request does not wait behind an answer nobody
reads (the OpenAI SDK retries a timed-out request on a new connection). A stream is
cancelled the same way by Starlette, which stops iterating it. A model's load is never cut
short by a client leaving: the next request needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from rp_service.errors import ServiceError
from rp_service.jobs.store import Store
from rp_service.openai.chat_schemas import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionCreate,
    Choice,
    ModelObject,
    ModelsList,
    Serving,
    Usage,
)
from rp_service.serving.manager import GenerationError, ServingManager
from rp_service.serving.models import ServedModel, list_models, resolve_model
from rp_service.settings import Settings

__all__ = ["Chat", "OpenedChat"]

_FINGERPRINT = "fp_roundpipe"
_DISCONNECT_POLL_S = 0.25  # how often a waiting client's connection is checked
_T = TypeVar("_T")


class ClientGone(ServiceError):
    """The client disconnected before its answer was complete (nginx's 499; never read)."""

    status_code = 499
    default_code = "client_closed_request"


def _error(message: dict[str, Any]) -> GenerationError:
    return GenerationError(
        str(message.get("message", "generation failed")),
        status=int(message.get("status", 500)),
        code=str(message.get("code", "generation_failed")),
    )


async def _unless_gone(work: Awaitable[_T], gone: Callable[[], Awaitable[bool]] | None) -> _T:
    """`work`'s result, cancelled (ClientGone) as soon as `gone()` says the client left;
    a cancelled work closes its replies, which tells the process (ServingProcess.request)."""
    task = asyncio.ensure_future(work)
    if gone is None:
        return await task
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await gone():
                break
    except BaseException:  # the route itself was cancelled (shutdown): so is its work
        task.cancel()
        raise
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientGone("the client disconnected; its request was cancelled")


@dataclass(slots=True)
class OpenedChat:
    """A request the process has accepted: its prompt is counted, its text is coming."""

    id: str
    created: int
    model: str
    prompt_tokens: int
    replies: AsyncGenerator[dict[str, Any], None]


class Chat:
    """OpenAI's chat completions and models over the serving manager."""

    def __init__(self, settings: Settings, store: Store, manager: ServingManager) -> None:
        self.settings = settings
        self.store = store
        self.manager = manager

    # ------------------------------------------------------------ models

    def _object(self, served: ServedModel | None, model: str) -> ModelObject:
        if served is None:  # a preset
            return ModelObject(id=model, created=0, owned_by="system")
        process = self.manager.processes.get(served.base.key)  # a stopping one included
        serving = None
        if process is not None and process.pid is not None and process.loaded:
            serving = Serving(pid=process.pid, device=process.device)
        return ModelObject(
            id=served.id, created=served.created, owned_by=served.owned_by, serving=serving
        )

    async def models(self) -> ModelsList:
        entries = await asyncio.to_thread(list_models, self.settings, self.store)
        return ModelsList(
            data=[ModelObject(id=e.id, created=e.created, owned_by=e.owned_by) for e in entries]
        )

    async def model(self, model: str) -> ModelObject:
        served = await asyncio.to_thread(
            resolve_model, self.settings, self.store, model, chat=False
        )
        return self._object(served, model)

    # ------------------------------------------------------------ completions

    async def open(
        self, body: ChatCompletionCreate, *, gone: Callable[[], Awaitable[bool]] | None = None
    ) -> OpenedChat:
        """Resolve, start the process if needed, and wait until the prompt is accepted
        (given up, ClientGone, once `gone()` says the client left while it waited its turn).

        Raises:
            NotFound, BadRequest: from the model's resolution.
            ServingBusy: no GPU, CPU slot, host memory or queue place free now.
            GenerationError: the process refused the request (no chat template, too long).
        """
        served = await asyncio.to_thread(resolve_model, self.settings, self.store, body.model)
        assert served is not None  # chat=True refuses presets
        replies = self.manager.generate(served, body.generation())
        first = await anext(replies)  # the model loaded, the request written to its process
        if first.get("type") == "queued":
            first = await _unless_gone(anext(replies), gone)
        if first.get("type") != "start":
            await replies.aclose()
            raise _error(first)
        return OpenedChat(
            id="chatcmpl-" + secrets.token_hex(12),
            created=int(time.time()),
            model=served.id,
            prompt_tokens=int(first["prompt_tokens"]),
            replies=replies,
        )

    async def complete(
        self, opened: OpenedChat, *, gone: Callable[[], Awaitable[bool]] | None = None
    ) -> ChatCompletion:
        """The whole answer as one `chat.completion`; cancelled (ClientGone) as soon as
        `gone()` says the client disconnected."""
        return await _unless_gone(self._complete(opened), gone)

    async def _complete(self, opened: OpenedChat) -> ChatCompletion:
        parts: list[str] = []
        async with contextlib.aclosing(opened.replies) as replies:
            async for message in replies:
                if message["type"] == "delta":
                    parts.append(message["text"])
                elif message["type"] == "error":
                    raise _error(message)
                elif message["type"] == "done":
                    done = message
                    break
        completion = int(done["completion_tokens"])
        return ChatCompletion(
            id=opened.id,
            created=opened.created,
            model=opened.model,
            choices=[
                Choice(
                    message=AssistantMessage(content="".join(parts)),
                    finish_reason=done["finish_reason"],
                )
            ],
            usage=Usage(
                prompt_tokens=opened.prompt_tokens,
                completion_tokens=completion,
                total_tokens=opened.prompt_tokens + completion,
            ),
            system_fingerprint=_FINGERPRINT,
        )

    async def chunks(self, opened: OpenedChat, *, include_usage: bool) -> AsyncIterator[bytes]:
        """Server-sent events as OpenAI sends them: a first chunk with the role, one per
        piece of text, one with the finish reason, the usage chunk when asked, [DONE]."""

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            body: dict[str, Any] = {
                "id": opened.id,
                "object": "chat.completion.chunk",
                "created": opened.created,
                "model": opened.model,
                "service_tier": "default",
                "system_fingerprint": _FINGERPRINT,
                "choices": choices,
            }
            if include_usage:
                body["usage"] = None  # null in every chunk but the last
            body.update(extra)
            return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

        def choice(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

        async with contextlib.aclosing(opened.replies) as replies:
            yield chunk([choice({"role": "assistant", "content": "", "refusal": None})])
            async for message in replies:
                if message["type"] == "delta":
                    yield chunk([choice({"content": message["text"]})])
                elif message["type"] == "error":
                    error = _error(message)
                    yield b"data: " + json.dumps(error.envelope()).encode() + b"\n\n"
                    return
                elif message["type"] == "done":
                    yield chunk([choice({}, message["finish_reason"])])
                    if include_usage:
                        completion = int(message["completion_tokens"])
                        usage = Usage(
                            prompt_tokens=opened.prompt_tokens,
                            completion_tokens=completion,
                            total_tokens=opened.prompt_tokens + completion,
                        )
                        yield chunk([], usage=usage.model_dump())
                    break
            yield b"data: [DONE]\n\n"
