"""OpenAI's chat completion and model shapes, as this daemon accepts and returns them.

Field names, types and ranges follow OpenAI's API reference; a parameter this daemon does
not implement is refused with a 400 naming it (extra="forbid", as the fine-tuning shapes),
never ignored. The streamed chunks are built in rp_service/openai/chat.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "MAX_STOP_CHARS",
    "ChatCompletion",
    "ChatCompletionCreate",
    "ChatMessage",
    "ModelObject",
    "ModelsList",
]

_MAX_STOPS = 4  # OpenAI's limit on stop sequences
# Characters in one stop sequence (OpenAI states no limit): a stop is held back while the
# answer may be starting it, so it is bounded like any other per-token cost.
MAX_STOP_CHARS = 1024


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    """One message; `content` as a string or as text parts (joined)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Request):
    include_usage: bool | None = None


class ChatCompletionCreate(_Request):
    """The body of `POST /v1/chat/completions` (the SDK's `chat.completions.create`)."""

    model: str = Field(..., min_length=1, max_length=4096)
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(None, ge=1, le=1 << 20)
    max_tokens: int | None = Field(None, ge=1, le=1 << 20)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # OpenAI's end-user id, for abuse monitoring there; accepted and not used here.
    user: str | None = Field(None, max_length=256)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError(f"only n=1 is supported (one choice per request), got {value}")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > _MAX_STOPS:
            raise ValueError(f"at most {_MAX_STOPS} stop sequences, got {len(value)}")
        stops = [value] if isinstance(value, str) else value or []
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(
                f"a stop sequence has at most {MAX_STOP_CHARS} characters, got one of {longest}"
            )
        return value

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def generation(self) -> dict[str, Any]:
        """What the serving process needs (rp_service/serving/process.py's request)."""
        temperature = self.temperature
        if self.top_p == 0:
            temperature = 0.0  # only the most likely token is left: greedy
        return {
            "messages": [{"role": m.role, "content": m.text()} for m in self.messages],
            "max_tokens": self.max_completion_tokens or self.max_tokens,
            "temperature": temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": self.stops(),
        }


# ---------------------------------------------------------------- objects


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: str | None = None
    annotations: list[Any] = Field(default_factory=list)


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    audio_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0
    audio_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = Field(
        default_factory=CompletionTokensDetails
    )


class ChatCompletion(BaseModel):
    """OpenAI's `chat.completion`."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    service_tier: str = "default"
    system_fingerprint: str | None = None


class Serving(BaseModel):
    """This daemon's extension of the model object: the process serving it now."""

    pid: int
    device: str


class ModelObject(BaseModel):
    """OpenAI's `model`; `serving` (this daemon's) is set while a process holds it."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    serving: Serving | None = None


class ModelsList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]
