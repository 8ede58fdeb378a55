"""SFT: the causal-LM loss on the trained tokens of token blocks (`train.objective: sft`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...data.datasets import DataFormatError, TokenBlocks, build_blocks, read_records
from ...demo import SYNTHETIC, SYNTHETIC_TRAIN_RECORDS, SYNTHETIC_VALID_RECORDS, synthetic_records
from ...errors import JobFailure
from ..evaluation import evaluate

if TYPE_CHECKING:
    from ...data.tokenizer import JobTokenizer
    from ...schemas import JobSpec
    from ..training import JobPaths

__all__ = ["SftObjective", "load_blocks"]


def load_blocks(
    source: str, param: str, spec: JobSpec, tokenizer: JobTokenizer, *, valid: bool
) -> tuple[str, TokenBlocks]:
    """The data format the records turned out to be in, and their sequences."""
    data = spec.data
    try:
        if source == SYNTHETIC:
            count = SYNTHETIC_VALID_RECORDS if valid else SYNTHETIC_TRAIN_RECORDS
            fmt, records = "text", synthetic_records(count, seed=0, valid=valid)
        else:
            if not Path(source).is_file():
                raise JobFailure("invalid_data", f"{param}: file {source!r} not found", param=param)
            fmt, records = read_records(source, data.format)
        if fmt == "prompt":
            raise DataFormatError(
                "these rows hold prompts only (no completion to train on): set "
                "train.objective to 'grpo' to train on them with a grader",
                line=0,
            )
        return fmt, build_blocks(
            records, fmt, tokenizer, seq_len=data.seq_len, packing=data.packing
        )
    except DataFormatError as exc:
        raise exc.in_field(param) from exc


class SftObjective:
    """Token blocks and the chunked causal-LM loss of one attempt of an SFT job."""

    needs_sync_before_step = False
    steps_per_batch = 1

    def __init__(
        self, spec: JobSpec, paths: JobPaths, tokenizer: JobTokenizer, *, valid_source: str | None
    ) -> None:
        self.batch_size = spec.train.batch_size
        self.data_format, self.train = load_blocks(
            paths.train_path, "data.train", spec, tokenizer, valid=False
        )
        self.valid: TokenBlocks | None = (
            load_blocks(valid_source, "data.valid", spec, tokenizer, valid=True)[1]
            if valid_source
            else None
        )
        self.vocab_size = 0

    def prepare(self, rp: Any, hf_model: Any, *, lora: bool, resuming: bool) -> None:
        self.vocab_size = int(hf_model.config.vocab_size)

    def forward_backward(self, rp: Any, step: int, indices: torch.Tensor) -> tuple[Any, int]:
        from engine.models import causal_lm_loss_fn

        input_ids, labels, tokens = self.train.batch(indices)
        loss = rp.forward_backward(
            input_kwargs={"input_ids": input_ids, "return_logits": False},
            label=labels,
            loss_fn=causal_lm_loss_fn(labels, shifted=True),
        )
        return loss, tokens

    def metrics(self) -> dict[str, Any] | None:
        return None

    def evaluate(self, rp: Any) -> dict[str, float]:
        assert self.valid is not None
        return {
            "valid_loss": evaluate(
                rp, self.valid, vocab_size=self.vocab_size, batch_size=self.batch_size
            )
        }

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass
