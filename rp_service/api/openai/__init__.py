"""OpenAI's fine-tuning API over the native job service (one store, one orchestrator).

Its files API is the native `/v1/files` (rp_service/api/files.py serves both shapes);
this package adds `/v1/fine_tuning/jobs`. The mapping is documented in docs/API.md.
"""

from __future__ import annotations

from rp_service.api.openai.jobs import router

__all__ = ["router"]
