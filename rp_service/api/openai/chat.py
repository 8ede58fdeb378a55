"""OpenAI's chat route: `POST /v1/chat/completions` (docs/CHAT.md)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from rp_service.api.deps import ChatDep
from rp_service.api.openai._route import OpenAIRoute
from rp_service.openai.chat_schemas import ChatCompletion, ChatCompletionCreate
from rp_service.schemas import ErrorEnvelope

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute)

_ERRORS = {
    400: {"model": ErrorEnvelope, "description": "an invalid or unsupported parameter"},
    404: {"model": ErrorEnvelope, "description": "no such model"},
    422: {
        "model": ErrorEnvelope,
        "description": "a stop sequence too long, a model over the "
        "host-memory budget, or a model folder missing weights",
    },
    503: {
        "model": ErrorEnvelope,
        "description": "no GPU, CPU slot, host memory or queue place free now (see Retry-After)",
    },
    504: {"model": ErrorEnvelope, "description": "the answer passed RP_SERVE_REQUEST_TIMEOUT_S"},
}


class _ClosingStream(StreamingResponse):
    """A stream that closes its answer however it ends: a client that leaves before the
    first chunk is sent cancels a stream that never started iterating (so its own
    clean-up never ran), and the serving process must still be told."""

    def __init__(
        self, content: AsyncIterator[bytes], *, close: Callable[[], Awaitable[Any]], **kw: Any
    ) -> None:
        super().__init__(content, **kw)
        self._close = close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()


@router.post(
    "/chat/completions",
    response_model=ChatCompletion,
    responses={
        **_ERRORS,
        200: {
            "description": "a chat.completion, or with stream=true server-sent "
            "chat.completion.chunk events ending in `data: [DONE]`",
            "content": {"text/event-stream": {}},
        },
    },
)
async def create_chat_completion(
    body: ChatCompletionCreate, service: ChatDep, request: Request
) -> ChatCompletion | StreamingResponse:
    """`chat.completions.create`: the model's answer to `messages` (its chat template)."""
    opened = await service.open(body, gone=request.is_disconnected)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _ClosingStream(
            service.chunks(opened, include_usage=include_usage),
            close=opened.replies.aclose,
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
        )
    return await service.complete(opened, gone=request.is_disconnected)
