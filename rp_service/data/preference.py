"""Preference data: the pair formats, their line checks, and the tokenised pairs DPO reads.

One JSON object a line, in either of two spellings (the format is ``preference``; ``auto``
detects it by its keys):

- OpenAI's: ``{"input": {"messages": [...]}, "preferred_output": [{"role": "assistant",
  "content": str}], "non_preferred_output": [...]}``; other keys of ``input`` (``tools``,
  ``parallel_tool_calls``) are accepted and not used;
- the common ``{"prompt", "chosen", "rejected"}``: all three strings (plain text), or
  ``prompt`` a list of messages and ``chosen``/``rejected`` lists of assistant messages
  (chat), as in TRL's conversational preference datasets.

A line whose chosen and rejected completions are identical is refused: the pair carries no
preference and only adds 0 to the gradient.

Tokenised, each pair is two rows of ``data.seq_len`` tokens: the prompt (no loss) followed by one completion (the
scored tokens) and the end-of-text token, right-padded. Chat pairs are rendered with the
tokenizer's chat template (`chat_template`), the chosen and rejected replies as the
trained turns of a ``chat`` record. Truncation: a row longer than
``data.seq_len`` keeps its start (the prompt and the beginning of its completion); a pair
whose prompt leaves no completion token within ``data.seq_len`` is refused with its line
number when the job starts (the tokenizer runs in the worker, not at upload).

No torch at import: the daemon checks uploads with `check_preference` without loading it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .tokenizer import JobTokenizer

__all__ = [
    "PREFERENCE_METRICS",
    "PreferencePairs",
    "build_pairs",
    "check_preference",
    "is_preference",
    "synthetic_pairs",
]

_ROLES = frozenset({"system", "user", "assistant", "tool"})
_IGNORE = -100

# The metrics of a preference (DPO) step, TRL's names: the worker emits them, the daemon
# keeps them as a DPO job's series and exports them (torch-free, so both sides read it).
PREFERENCE_METRICS: tuple[str, ...] = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def is_preference(record: dict[str, Any]) -> bool:
    """Whether a record is spelled as a preference pair (decides ``auto`` detection)."""
    return (
        "preferred_output" in record
        or "non_preferred_output" in record
        or ("chosen" in record or "rejected" in record)
    )


def _messages(value: Any, where: str, *, assistant_only: bool = False) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ValueError(f'"{where}" must be a non-empty list of {{"role", "content"}} objects')
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise ValueError(f'"{where}[{i}]" must be an object with "role" and "content"')
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or role not in _ROLES:
            raise ValueError(f'"{where}[{i}].role" must be one of {sorted(_ROLES)}')
        if assistant_only and role != "assistant":
            raise ValueError(f'"{where}[{i}].role" must be "assistant", got {role[:40]!r}')
        if not isinstance(content, str):
            raise ValueError(f'"{where}[{i}].content" must be a string')
    return value


def _normalise(record: dict[str, Any]) -> tuple[Any, Any, Any]:
    """`(prompt, chosen, rejected)`: three strings, or a message list and two lists of
    assistant messages. Raises ValueError naming the bad field."""
    if "preferred_output" in record or "non_preferred_output" in record or "input" in record:
        source = record.get("input")
        if not isinstance(source, dict):
            raise ValueError('"input" must be an object with "messages"')
        prompt = _messages(source.get("messages"), "input.messages")
        chosen = _messages(record.get("preferred_output"), "preferred_output", assistant_only=True)
        rejected = _messages(
            record.get("non_preferred_output"), "non_preferred_output", assistant_only=True
        )
        return prompt, chosen, rejected
    for key in ("prompt", "chosen", "rejected"):
        if key not in record:
            raise ValueError(f'"{key}" is missing: a pair needs "prompt", "chosen" and "rejected"')
    prompt, chosen, rejected = record["prompt"], record["chosen"], record["rejected"]
    if isinstance(prompt, str):
        for key, value in (("chosen", chosen), ("rejected", rejected)):
            if not isinstance(value, str):
                raise ValueError(f'"{key}" must be a string like "prompt" (plain text)')
            if not value:
                raise ValueError(f'"{key}" is empty: there would be nothing to score')
        return prompt, chosen, rejected
    prompt = _messages(prompt, "prompt")
    chosen = _messages(chosen, "chosen", assistant_only=True)
    rejected = _messages(rejected, "rejected", assistant_only=True)
    return prompt, chosen, rejected


def check_preference(record: dict[str, Any]) -> None:
    """Check one preference line; raises ValueError saying what is wrong."""
    _, chosen, rejected = _normalise(record)
    if chosen == rejected:
        raise ValueError(
            "the chosen and rejected completions are identical: the pair expresses no "
            "preference; drop the line or fix one side"
        )


# ---------------------------------------------------------------- tokenisation


def _pieces(prompt: Any, completion: Any, hf: Any) -> list[tuple[str, bool]]:
    """`(text, scored)` pieces of one row: the prompt, then the completion; a chat pair is
    rendered with the tokenizer's chat template, as the ``chat`` format is."""
    from .chat_template import chat_pieces

    if isinstance(prompt, str):
        return [(prompt, False), (completion, True)]
    return chat_pieces(hf, [*prompt, *completion], trained_from=len(prompt))


@dataclass(frozen=True, slots=True)
class PreferencePairs:
    """Tokenised pairs, each a chosen row and a rejected row.

    Attributes:
        input_ids: (pairs, 2, seq_len) int32; [:, 0] chosen, [:, 1] rejected.
        targets: (pairs, 2, seq_len) int32 next-token targets of the completion tokens,
            -100 elsewhere (prompt, padding).
        tokens: (pairs,) int64 non-padding tokens of both rows.
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    tokens: torch.Tensor

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[2])

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`(input_ids, targets, tokens)` of the pairs at `indices`: rows chosen, rejected,
        chosen, ... as (2 * len(indices), seq_len) int64."""
        seq = self.seq_len
        return (
            self.input_ids[indices].reshape(-1, seq).long(),
            self.targets[indices].reshape(-1, seq).long(),
            int(self.tokens[indices].sum()),
        )

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every pair's rows in order, as `batch` gives them."""
        seq = self.seq_len
        return self.input_ids.reshape(-1, seq).long(), self.targets.reshape(-1, seq).long()


def build_pairs(
    records: list[tuple[int, dict[str, Any]]], tokenizer: JobTokenizer, *, seq_len: int
) -> PreferencePairs:
    """Tokenise `(line, record)` preference records into rows of `seq_len` tokens.

    Raises:
        DataFormatError: a pair whose prompt leaves no completion token (naming its line),
            or no records.
    """
    import torch

    from .formats import DataFormatError

    if not records:
        raise DataFormatError("the dataset has no records (every line is blank)", line=0)
    from .chat_template import TemplateError

    rows: list[list[tuple[str, bool]]] = []
    for line, record in records:
        prompt, chosen, rejected = _normalise(record)
        try:
            rows += [_pieces(prompt, chosen, tokenizer.hf), _pieces(prompt, rejected, tokenizer.hf)]
        except TemplateError as exc:
            raise DataFormatError(str(exc), line=line) from None
    encoded = iter(tokenizer.encode([text for row in rows for text, _ in row]))
    count = len(records)
    input_ids = torch.full((count, 2, seq_len), tokenizer.pad_id, dtype=torch.int32)
    targets = torch.full((count, 2, seq_len), _IGNORE, dtype=torch.int32)
    tokens = torch.zeros(count, dtype=torch.int64)
    for r, row in enumerate(rows):
        ids: list[int] = []
        scored: list[bool] = []
        for _, flag in row:
            piece = next(encoded)
            ids += piece
            scored += [flag] * len(piece)
        if tokenizer.eos_id is not None:
            ids.append(tokenizer.eos_id)
            scored.append(True)
        ids, scored = ids[: seq_len + 1], scored[: seq_len + 1]  # keep the start
        pair, side = divmod(r, 2)
        if not any(scored[1:]):
            raise DataFormatError(
                f"the prompt fills data.seq_len={seq_len} tokens and leaves none of the "
                f"{'chosen' if side == 0 else 'rejected'} completion; raise data.seq_len or "
                "shorten the prompt",
                line=records[pair][0],
            )
        n = len(ids) - 1
        ids_t = torch.tensor(ids, dtype=torch.int32)
        keep = torch.tensor(scored[1:], dtype=torch.bool)
        input_ids[pair, side, :n] = ids_t[:-1]
        targets[pair, side, :n] = torch.where(keep, ids_t[1:], _IGNORE)
        tokens[pair] += n
    return PreferencePairs(input_ids=input_ids, targets=targets, tokens=tokens)


def synthetic_pairs(count: int, *, seed: int, valid: bool = False) -> list[dict[str, Any]]:
    """`count` generated plain-text pairs for the demo: a counting prompt whose chosen
    completion continues the count and whose rejected completion repeats a number."""
    import random

    rng = random.Random(seed * 2 + int(valid))
    out = []
    for _ in range(count):
        start = rng.randrange(0, 900)
        length = rng.randrange(3, 7)
        prompt = "count: " + " ".join(str(start + i) for i in range(length))
        good = " ".join(str(start + length + i) for i in range(3))
        bad = " ".join(str(start + length - 1) for _ in range(3))
        out.append({"prompt": prompt, "chosen": " " + good, "rejected": " " + bad})
    return out
