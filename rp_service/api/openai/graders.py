"""OpenAI's grader routes: `POST /v1/fine_tuning/alpha/graders/validate` and `/run`."""

from __future__ import annotations

from fastapi import APIRouter

from rp_service.api.deps import GradersDep
from rp_service.api.openai._route import OpenAIRoute
from rp_service.openai.grader_schemas import (
    GraderRunRequest,
    GraderRunResponse,
    GraderValidateRequest,
    GraderValidateResponse,
)
from rp_service.schemas import ErrorEnvelope

__all__ = ["router"]

router = APIRouter(prefix="/v1/fine_tuning/alpha/graders", tags=["openai"], route_class=OpenAIRoute)
_ERRORS = {400: {"model": ErrorEnvelope, "description": "a grader that cannot run here"}}


@router.post("/validate", response_model=GraderValidateResponse, responses=_ERRORS)
async def validate_grader(
    body: GraderValidateRequest, service: GradersDep
) -> GraderValidateResponse:
    """The grader back if it can run on this box; a 400 naming the field otherwise."""
    return await service.validate(body)


@router.post("/run", response_model=GraderRunResponse, responses=_ERRORS)
async def run_grader(body: GraderRunRequest, service: GradersDep) -> GraderRunResponse:
    """The grader's reward for one `model_sample` and `item` (docs/RL.md#graders)."""
    return await service.run(body)
