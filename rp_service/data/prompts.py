"""Prompt rows of a GRPO job: the prompts the policy answers and the items graders read.

A row (data format ``prompt``, checked by `formats`) is OpenAI's reinforcement row,
``{"messages": [...], ...}`` ending where the model answers, or TRL's
``{"prompt": str | [...], ...}``; the whole row is the `item` whose fields a grader's
templates name (``{{item.answer}}``). Messages are rendered with the tokenizer's chat
template, the assistant's turn opened; a plain-string prompt is the text as is (as the
``prompt_completion`` format renders its prompts).

Torch-free, so the daemon reads `GRPO_METRICS` without loading torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .chat_template import TemplateError, generation_prompt
from .formats import DataFormatError

if TYPE_CHECKING:
    from .tokenizer import JobTokenizer

__all__ = ["GRPO_METRICS", "PromptRows", "build_prompts", "prompt_text", "synthetic_prompts"]

# The scalar metrics of a GRPO step (the contract with the dashboard); the `metrics` event
# also carries `rewards`, a dict of each grader's mean score.
GRPO_METRICS: tuple[str, ...] = (
    "reward_mean",
    "reward_std",
    "kl",
    "clip_fraction",
    "completion_tokens_mean",
    "grader_errors",
    "valid_reward_mean",
)


@dataclass(frozen=True, slots=True)
class PromptRows:
    """Tokenised prompts and their rows (`items[i]` is prompt i's row, as read)."""

    ids: list[list[int]]
    items: list[dict[str, Any]]
    texts: list[str]  # each prompt as the model reads it (shown in `sample` events)

    def __len__(self) -> int:
        return len(self.ids)


def _messages(record: dict[str, Any]) -> list[dict[str, Any]] | None:
    if "messages" in record:
        return record["messages"]
    prompt = record.get("prompt")
    return prompt if isinstance(prompt, list) else None


def prompt_text(record: dict[str, Any], tokenizer: JobTokenizer) -> str:
    """The text the model continues: the messages in the chat template, or the prompt."""
    messages = _messages(record)
    if messages is None:
        return str(record["prompt"])
    return generation_prompt(tokenizer.hf, messages)


def build_prompts(
    records: Iterable[tuple[int, dict[str, Any]]], tokenizer: JobTokenizer, *, max_tokens: int
) -> PromptRows:
    """Tokenise `(line, record)` prompt rows; a prompt over `max_tokens` is an error
    naming its line (the completion needs the rest of the sequence)."""
    ids: list[list[int]] = []
    items: list[dict[str, Any]] = []
    texts: list[str] = []
    for line, record in records:
        try:
            text = prompt_text(record, tokenizer)
        except TemplateError as exc:
            raise DataFormatError(str(exc), line=line) from None
        tokens = tokenizer.encode([text])[0]
        if len(tokens) > max_tokens:
            raise DataFormatError(
                f"the prompt is {len(tokens)} tokens, above data.seq_len {max_tokens}; "
                "shorten it or raise data.seq_len",
                line=line,
            )
        if not tokens:
            raise DataFormatError("the prompt renders to no tokens", line=line)
        ids.append(tokens)
        items.append(record)
        texts.append(text)
    if not ids:
        raise DataFormatError("the dataset has no records (every line is blank)", line=0)
    return PromptRows(ids=ids, items=items, texts=texts)


def synthetic_prompts(count: int, *, seed: int, valid: bool = False) -> list[dict[str, Any]]:
    """`count` generated prompt rows for the demo (`rp demo --grpo`): a user asking for a
    "y", the row's `answer` the letter a string_check grader looks for."""
    import random

    rng = random.Random(seed * 2 + int(valid))
    return [
        {"messages": [{"role": "user", "content": f"say y {rng.randrange(1000)}"}], "answer": "y"}
        for _ in range(count)
    ]
