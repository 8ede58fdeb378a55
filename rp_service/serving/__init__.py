"""Chat with trained models: the serving process kind and what the daemon keeps of it.

models   model ids (`ft:<base>:<job-id>`, base names) -> what to load; `GET /v1/models`
manager  the daemon side: one serving process per base, started on demand, stopped when
         idle, a GPU lent by the orchestrator (or the CPU)
process  the process: `python -m rp_service.serving`, transformers' generate + peft adapters

OpenAI's chat.completion objects and chunks are shaped from its replies in
rp_service.openai.chat.
"""

from __future__ import annotations

from rp_service.serving.manager import ServingBusy, ServingManager

__all__ = ["ServingBusy", "ServingManager"]
