"""Training data: jsonl parsing and validation, tokenisation, packing, and the batch order.

Three jsonl formats, one JSON object a line (blank lines are skipped, but counted in line
numbers):

- ``text``: ``{"text": str}``, trained on every token;
- ``chat``: ``{"messages": [{"role": str, "content": str}, ...]}``, rendered as ChatML
  and trained on the assistant turns only;
- ``prompt_completion``: ``{"prompt": str, "completion": str}``, trained on the completion.

Each record ends with the tokenizer's end-of-text token. With packing, all records form one
token stream cut into blocks of ``seq_len``; without it, each record is truncated or padded
to ``seq_len``. Labels come pre-shifted: ``labels[i, t]`` is the token that should follow
``input_ids[i, t]``, or ``-100`` where no loss is taken.

The batch of optimizer step ``k`` is a pure function of ``(seed, k)`` (one seeded
permutation per epoch), so resuming from a checkpoint only needs the step number.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from .tokenizer import IM_END, IM_START

if TYPE_CHECKING:
    from .tokenizer import JobTokenizer

__all__ = [
    "FORMATS",
    "IGNORE_INDEX",
    "BatchOrder",
    "DataFormat",
    "DataFormatError",
    "TokenBlocks",
    "build_blocks",
    "iter_records",
    "read_records",
    "tokenize_records",
    "validate_jsonl",
]

DataFormat = Literal["text", "chat", "prompt_completion"]
FORMATS: tuple[DataFormat, ...] = ("text", "chat", "prompt_completion")
IGNORE_INDEX = -100
"""Label value that takes no loss (padding, prompts, non-assistant chat turns)."""

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
_MAX_SHOWN = 80  # characters of a bad value quoted back in an error message


class DataFormatError(ValueError):
    """A dataset line is malformed; `line` is its 1-based line number (0: the whole file)."""

    def __init__(self, message: str, *, line: int) -> None:
        super().__init__(f"line {line}: {message}" if line else message)
        self.line = line
        self.message = message


# ---------------------------------------------------------------- parsing and validation


def _require_str(record: dict[str, Any], key: str, *, where: str = "") -> str:
    value = record.get(key)
    if not isinstance(value, str):
        got = "missing" if key not in record else f"a {type(value).__name__}"
        raise ValueError(f'"{where}{key}" must be a string, got {got}')
    return value


def _check_text(record: dict[str, Any]) -> None:
    if not _require_str(record, "text"):
        raise ValueError('"text" is empty')


def _check_prompt_completion(record: dict[str, Any]) -> None:
    _require_str(record, "prompt")
    if not _require_str(record, "completion"):
        raise ValueError('"completion" is empty: there would be nothing to train on')


def _check_chat(record: dict[str, Any]) -> None:
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError('"messages" must be a non-empty list of {"role", "content"} objects')
    has_assistant = False
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f'"messages[{i}]" must be an object with "role" and "content"')
        role = _require_str(message, "role", where=f"messages[{i}].")
        if role not in CHAT_ROLES:
            raise ValueError(
                f'"messages[{i}].role" is {role[:_MAX_SHOWN]!r}; allowed: {sorted(CHAT_ROLES)}'
            )
        _require_str(message, "content", where=f"messages[{i}].")
        has_assistant = has_assistant or role == "assistant"
    if not has_assistant:
        raise ValueError(
            '"messages" has no "assistant" message: there would be nothing to train on'
        )


_CHECKS = {"text": _check_text, "chat": _check_chat, "prompt_completion": _check_prompt_completion}


def _detect(record: dict[str, Any]) -> DataFormat:
    if "messages" in record:
        return "chat"
    if "prompt" in record or "completion" in record:
        return "prompt_completion"
    if "text" in record:
        return "text"
    keys = ", ".join(sorted(record)[:8]) or "none"
    raise ValueError(
        'cannot tell the format: expected a "text", "messages" or "prompt"/"completion" key, '
        f"found keys: {keys}"
    )


def _lines(source: str | Path | Iterable[str | bytes]) -> Iterator[str | bytes]:
    if isinstance(source, (str, Path)):
        with open(source, "rb") as f:
            yield from f
    else:
        yield from source


def iter_records(
    source: str | Path | Iterable[str | bytes], format: str = "auto"
) -> Iterator[tuple[int, DataFormat, dict[str, Any]]]:
    """Yield `(line_number, format, record)` for each non-blank line, validating as it goes.

    Args:
        source: a jsonl file path, or its lines (str or bytes).
        format: ``auto`` (decided by the first record; every later line must match it),
            ``text``, ``chat`` or ``prompt_completion``.

    Raises:
        DataFormatError: at the first malformed line, naming it.
    """
    if format != "auto" and format not in _CHECKS:
        raise DataFormatError(f"unknown format {format!r}; use auto, {', '.join(FORMATS)}", line=0)
    fmt: DataFormat | None = None if format == "auto" else format  # type: ignore[assignment]
    for number, raw in enumerate(_lines(source), start=1):
        try:
            text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        except UnicodeDecodeError as exc:
            raise DataFormatError(f"not valid UTF-8 ({exc.reason})", line=number) from exc
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataFormatError(
                f"not valid JSON ({exc.msg} at column {exc.colno})", line=number
            ) from exc
        if not isinstance(record, dict):
            raise DataFormatError(
                f"expected a JSON object, got a {type(record).__name__}", line=number
            )
        try:
            if fmt is None:
                fmt = _detect(record)
            _CHECKS[fmt](record)
        except ValueError as exc:
            raise DataFormatError(f"{exc} (format {fmt or 'auto'})", line=number) from exc
        yield number, fmt, record


def validate_jsonl(
    path_or_lines: str | Path | Iterable[str | bytes], format: str = "auto"
) -> tuple[int, DataFormat]:
    """Check a whole jsonl dataset; return `(record_count, detected_format)`.

    Raises:
        DataFormatError: the first malformed line, or ``line=0`` for a file without records.
    """
    count = 0
    fmt: DataFormat | None = None
    for _, line_format, _record in iter_records(path_or_lines, format):
        count += 1
        fmt = line_format
    if count == 0 or fmt is None:
        raise DataFormatError("the dataset has no records (every line is blank)", line=0)
    return count, fmt


def read_records(
    source: str | Path | Iterable[str | bytes], format: str = "auto"
) -> tuple[DataFormat, list[dict[str, Any]]]:
    """All records of a dataset and its format (validated as in `validate_jsonl`)."""
    records: list[dict[str, Any]] = []
    fmt: DataFormat | None = None
    for _, line_format, record in iter_records(source, format):
        records.append(record)
        fmt = line_format
    if fmt is None:
        raise DataFormatError("the dataset has no records (every line is blank)", line=0)
    return fmt, records


# ---------------------------------------------------------------- tokenisation


@dataclass(frozen=True, slots=True)
class _Piece:
    text: str
    trained: bool


def _pieces(record: dict[str, Any], fmt: DataFormat) -> list[_Piece]:
    if fmt == "text":
        return [_Piece(record["text"], True)]
    if fmt == "prompt_completion":
        return [_Piece(record["prompt"], False), _Piece(record["completion"], True)]
    pieces: list[_Piece] = []
    for message in record["messages"]:
        assistant = message["role"] == "assistant"
        # The model learns to write the reply and to close it; the header is given.
        pieces.append(_Piece(f"{IM_START}{message['role']}\n", False))
        pieces.append(_Piece(message["content"], assistant))
        pieces.append(_Piece(IM_END, assistant))
        pieces.append(_Piece("\n", False))
    return pieces


def tokenize_records(
    records: list[dict[str, Any]], fmt: DataFormat, tokenizer: JobTokenizer
) -> list[tuple[list[int], list[bool]]]:
    """Token ids and a trained-on flag per token, for each record (eos appended)."""
    per_record = [_pieces(r, fmt) for r in records]
    flat = [p.text for pieces in per_record for p in pieces]
    encoded = iter(tokenizer.encode(flat))  # one batched call: the fast tokenizer is parallel
    out: list[tuple[list[int], list[bool]]] = []
    for pieces in per_record:
        ids: list[int] = []
        trained: list[bool] = []
        for piece in pieces:
            piece_ids = next(encoded)
            ids.extend(piece_ids)
            trained.extend([piece.trained] * len(piece_ids))
        if tokenizer.eos_id is not None:
            ids.append(tokenizer.eos_id)
            trained.append(True)
        out.append((ids, trained))
    return out


# ---------------------------------------------------------------- blocks and order


@dataclass(frozen=True, slots=True)
class TokenBlocks:
    """Fixed-length training sequences.

    Attributes:
        input_ids: (num_blocks, seq_len) int32 token ids.
        labels: (num_blocks, seq_len) int32 next-token targets, IGNORE_INDEX where untrained.
        tokens: (num_blocks,) int64 count of non-padding input tokens per block.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    tokens: torch.Tensor

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`(input_ids, labels, tokens)` of the blocks at `indices`, ids as int64."""
        return (
            self.input_ids[indices].long(),
            self.labels[indices].long(),
            int(self.tokens[indices].sum()),
        )


def _pack(examples: list[tuple[list[int], list[bool]]], seq_len: int) -> TokenBlocks:
    ids = torch.tensor([t for e in examples for t in e[0]], dtype=torch.int32)
    trained = torch.tensor([f for e in examples for f in e[1]], dtype=torch.bool)
    num_blocks = (ids.numel() - 1) // seq_len
    if num_blocks < 1:
        raise DataFormatError(
            f"the dataset has {ids.numel()} tokens, fewer than data.seq_len + 1 = {seq_len + 1}; "
            "lower data.seq_len or add data",
            line=0,
        )
    span = num_blocks * seq_len
    # Targets are the stream shifted by one: the last target of block i is the first input
    # of block i + 1, so every token but the very first is a target exactly once.
    targets = torch.where(trained[1 : span + 1], ids[1 : span + 1], IGNORE_INDEX)
    input_ids = ids[:span].view(num_blocks, seq_len)
    labels = targets.to(torch.int32).view(num_blocks, seq_len)
    tokens = torch.full((num_blocks,), seq_len, dtype=torch.int64)
    return TokenBlocks(input_ids=input_ids, labels=labels, tokens=tokens)


def _pad(examples: list[tuple[list[int], list[bool]]], seq_len: int, pad_id: int) -> TokenBlocks:
    usable = [e for e in examples if len(e[0]) >= 2]
    if not usable:
        raise DataFormatError("every record is shorter than 2 tokens", line=0)
    input_ids = torch.full((len(usable), seq_len), pad_id, dtype=torch.int32)
    labels = torch.full((len(usable), seq_len), IGNORE_INDEX, dtype=torch.int32)
    tokens = torch.empty(len(usable), dtype=torch.int64)
    for row, (ids, trained) in enumerate(usable):
        ids_t = torch.tensor(ids[: seq_len + 1], dtype=torch.int32)
        trained_t = torch.tensor(trained[: seq_len + 1], dtype=torch.bool)
        n = ids_t.numel() - 1
        input_ids[row, :n] = ids_t[:-1]
        labels[row, :n] = torch.where(trained_t[1:], ids_t[1:], IGNORE_INDEX)
        tokens[row] = n
    return TokenBlocks(input_ids=input_ids, labels=labels, tokens=tokens)


def build_blocks(
    records: list[dict[str, Any]],
    fmt: DataFormat,
    tokenizer: JobTokenizer,
    *,
    seq_len: int,
    packing: bool,
) -> TokenBlocks:
    """Tokenise `records` and cut them into `seq_len` training sequences.

    Raises:
        DataFormatError: ``line=0`` when the data is too short to form one sequence.
    """
    examples = tokenize_records(records, fmt, tokenizer)
    if packing:
        return _pack(examples, seq_len)
    return _pad(examples, seq_len, tokenizer.pad_id)


class BatchOrder:
    """Which blocks make the batch of each step: a seeded permutation per epoch.

    Step `k` takes the positions ``k * batch_size ...`` of the endless sequence
    ``perm(0) + perm(1) + ...``, so the order depends only on the seed and the step.
    """

    def __init__(self, num_blocks: int, batch_size: int, *, seed: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.batch_size = batch_size
        self.seed = seed
        self._cached: tuple[int, torch.Tensor] | None = None

    def _perm(self, epoch: int) -> torch.Tensor:
        if self._cached is None or self._cached[0] != epoch:
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % (1 << 63))
            self._cached = (epoch, torch.randperm(self.num_blocks, generator=gen))
        return self._cached[1]

    def indices(self, step: int) -> torch.Tensor:
        """Block indices of the batch of 0-based step `step`."""
        start = step * self.batch_size
        out = torch.empty(self.batch_size, dtype=torch.int64)
        filled = 0
        while filled < self.batch_size:
            epoch, offset = divmod(start + filled, self.num_blocks)
            take = min(self.batch_size - filled, self.num_blocks - offset)
            out[filled : filled + take] = self._perm(epoch)[offset : offset + take]
            filled += take
        return out

    def position(self, steps_done: int) -> dict[str, int]:
        """Where the data stands after `steps_done` steps: epoch and offset in it."""
        epoch, offset = divmod(steps_done * self.batch_size, self.num_blocks)
        return {"epoch": epoch, "offset": offset, "samples": steps_done * self.batch_size}

    def epoch(self, steps_done: int) -> float:
        """Epochs completed after `steps_done` steps, fractional."""
        return steps_done * self.batch_size / self.num_blocks

    def steps_for_epochs(self, epochs: float) -> int:
        """Optimizer steps that cover `epochs` passes over the blocks (at least 1)."""
        return max(1, math.ceil(epochs * self.num_blocks / self.batch_size))
