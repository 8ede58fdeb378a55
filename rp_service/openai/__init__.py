"""OpenAI's API over the native services: the facade's logic, which `rp_service.api.openai`
serves over HTTP.

schemas       the fine-tuning shapes (create request, job, event, checkpoint)
chat_schemas  the chat completion and model shapes
mapping       pure translation between OpenAI's fine-tuning shapes and the native ones
fine_tuning   FineTuning: `fine_tuning.jobs` over the store and the orchestrator
grader_schemas the `fine_tuning.alpha.graders` shapes
graders       Graders: `fine_tuning.alpha.graders` validate and run (rp_service.graders)
chat          Chat: `chat.completions` and `models` over the serving manager

Nothing here imports `rp_service.api`; docs/API.md and docs/CHAT.md are the mapping's
tables.
"""

from __future__ import annotations

from rp_service.openai.chat import Chat, OpenedChat
from rp_service.openai.fine_tuning import FineTuning
from rp_service.openai.graders import Graders

__all__ = ["Chat", "FineTuning", "Graders", "OpenedChat"]
