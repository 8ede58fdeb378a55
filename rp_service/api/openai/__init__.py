"""OpenAI's API over HTTP: routes that parse, call `rp_service.openai` and return its shapes.

Its files API is the native `/v1/files` (rp_service/api/files.py serves both shapes);
this package adds `/v1/fine_tuning/jobs` (jobs.py), `/v1/chat/completions` (chat.py),
`/v1/models` (models.py) and `/v1/fine_tuning/alpha/graders` (graders.py). The mapping is
documented in docs/API.md, docs/CHAT.md and docs/RL.md.
"""

from __future__ import annotations

from fastapi import APIRouter

from rp_service.api.openai import chat, graders, jobs, models

router = APIRouter()
router.include_router(jobs.router)
router.include_router(chat.router)
router.include_router(models.router)
router.include_router(graders.router)

__all__ = ["router"]
