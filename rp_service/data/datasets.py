"""Training data: jsonl parsing and validation, tokenisation, packing, and the batch order.

Three jsonl formats, one JSON object a line (blank lines are skipped, but counted in line
numbers):

- ``text``: ``{"text": str}``, trained on every token;
- ``chat``: ``{"messages": [{"role": str, "content": str}, ...]}``, rendered with the
  tokenizer's chat template (`chat_template`: the model folder's own, ChatML for presets)
  and trained on the assistant replies only;
- ``prompt_completion``: ``{"prompt": str, "completion": str}``, trained on the completion.

Each record ends with the tokenizer's end-of-text token. With packing, all records form one
token stream cut into blocks of ``seq_len``; without it, each record is truncated or padded
to ``seq_len``. Labels come pre-shifted: ``labels[i, t]`` is the token that should follow
``input_ids[i, t]``, or ``-100`` where no loss is taken.

The batch of optimizer step ``k`` is a pure function of ``(seed, k)`` (one seeded
permutation per epoch), so resuming from a checkpoint only needs the step number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .chat_template import TemplateError, chat_pieces
from .formats import (
    FORMATS,
    DataFormat,
    DataFormatError,
    iter_records,
    read_records,
    validate_jsonl,
)

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

IGNORE_INDEX = -100
"""Label value that takes no loss (padding, prompts, non-assistant chat turns)."""


# ---------------------------------------------------------------- tokenisation


@dataclass(frozen=True, slots=True)
class _Piece:
    text: str
    trained: bool


def _pieces(record: dict[str, Any], fmt: DataFormat, hf: Any, number: int) -> list[_Piece]:
    if fmt == "text":
        return [_Piece(record["text"], True)]
    if fmt == "prompt_completion":
        return [_Piece(record["prompt"], False), _Piece(record["completion"], True)]
    try:
        return [_Piece(text, trained) for text, trained in chat_pieces(hf, record["messages"])]
    except TemplateError as exc:
        raise DataFormatError(f"record {number}: {exc}", line=0) from None


def tokenize_records(
    records: list[dict[str, Any]], fmt: DataFormat, tokenizer: JobTokenizer
) -> list[tuple[list[int], list[bool]]]:
    """Token ids and a trained-on flag per token, for each record (eos appended)."""
    per_record = [_pieces(r, fmt, tokenizer.hf, n + 1) for n, r in enumerate(records)]
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
    if fmt == "preference":
        raise DataFormatError(
            "the data holds preference pairs, which train with train.objective dpo; set it, "
            "or give text, chat or prompt_completion data",
            line=0,
        )
    examples = tokenize_records(records, fmt, tokenizer)
    if packing:
        return _pack(examples, seq_len)
    return _pad(examples, seq_len, tokenizer.pad_id)


class BatchOrder:
    """Which blocks make the batch of each step: a seeded permutation per epoch.

    Step `k` takes the positions ``k * batch_size ...`` of the endless sequence
    ``perm(0) + perm(1) + ...``, so the order depends only on the seed and the step.
    With `repeat` r > 1 each batch serves r consecutive steps (GRPO's `num_iterations`:
    several updates on one batch of rollouts): step k takes batch k // r.
    """

    def __init__(self, num_blocks: int, batch_size: int, *, seed: int, repeat: int = 1) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if repeat < 1:
            raise ValueError("repeat must be >= 1")
        self.num_blocks = num_blocks
        self.batch_size = batch_size
        self.seed = seed
        self.repeat = repeat
        self._cached: tuple[int, torch.Tensor] | None = None

    def _perm(self, epoch: int) -> torch.Tensor:
        if self._cached is None or self._cached[0] != epoch:
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % (1 << 63))
            self._cached = (epoch, torch.randperm(self.num_blocks, generator=gen))
        return self._cached[1]

    def indices(self, step: int) -> torch.Tensor:
        """Block indices of the batch of 0-based step `step`."""
        start = step // self.repeat * self.batch_size
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
        samples = self._batches(steps_done) * self.batch_size
        epoch, offset = divmod(samples, self.num_blocks)
        return {"epoch": epoch, "offset": offset, "samples": samples}

    def epoch(self, steps_done: int) -> float:
        """Epochs completed after `steps_done` steps, fractional."""
        return self._batches(steps_done) * self.batch_size / self.num_blocks

    def _batches(self, steps_done: int) -> int:
        """Batches taken by `steps_done` steps (a batch is taken at its first step)."""
        return -(-steps_done // self.repeat)

    def steps_for_epochs(self, epochs: float) -> int:
        """Optimizer steps that cover `epochs` passes over the blocks (at least 1)."""
        return self.repeat * max(1, math.ceil(epochs * self.num_blocks / self.batch_size))
