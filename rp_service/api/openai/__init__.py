"""OpenAI's API over HTTP: routes that parse, call `rp_service.openai` and return its shapes.

Its files API is the native `/v1/files` (rp_service/api/files.py serves both shapes);
this package adds `/v1/fine_tuning/jobs` (jobs.py), `/v1/chat/completions` (chat.py) and
`/v1/models` (models.py). The mapping is documented in docs/API.md and docs/CHAT.md.
"""

from __future__ import annotations

from fastapi import APIRouter

from rp_service.api.openai import chat, jobs, models

router = APIRouter()
router.include_router(jobs.router)
router.include_router(chat.router)
router.include_router(models.router)

__all__ = ["router"]
