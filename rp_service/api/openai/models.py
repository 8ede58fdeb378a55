"""OpenAI's model routes: `GET /v1/models` and `GET /v1/models/{model}` (docs/CHAT.md)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from rp_service.api.deps import ChatDep
from rp_service.api.openai._route import OpenAIRoute
from rp_service.openai.chat_schemas import ModelObject, ModelsList
from rp_service.schemas import ErrorEnvelope

__all__ = ["router"]

router = APIRouter(prefix="/v1/models", tags=["openai"], route_class=OpenAIRoute)


@router.get("", response_model=ModelsList)
async def list_models(service: ChatDep) -> ModelsList:
    """Presets, model folders under RP_MODEL_ROOTS, and the fine-tuned models (ft:...)."""
    return await service.models()


@router.get(
    "/{model:path}",
    response_model=ModelObject,
    responses={404: {"model": ErrorEnvelope, "description": "no such model"}},
)
async def retrieve_model(
    model: Annotated[str, Path(min_length=1, max_length=4096)], service: ChatDep
) -> ModelObject:
    """One model; `serving` names the process holding it in memory, if one does."""
    return await service.model(model)
