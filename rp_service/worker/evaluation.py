"""The validation loss of a job's model: a no-grad forward over the first sequences."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..data.datasets import TokenBlocks

__all__ = ["MAX_EVAL_BLOCKS", "evaluate", "evaluating"]

MAX_EVAL_BLOCKS = 256  # validation sequences per evaluation (the first ones, in order)
_EVAL_LOGITS = 1 << 28  # logits elements per evaluation forward


@contextlib.contextmanager
def evaluating(rp: Any) -> Iterator[None]:
    """`rp` in eval mode for a validation loss or samples (dropout off, as a trainer
    evaluates: a LoRA job's lora.dropout would otherwise draw in every evaluation forward),
    back in training mode after."""
    rp.eval()
    try:
        yield
    finally:
        rp.train()


def evaluate(rp: Any, valid: TokenBlocks, *, vocab_size: int, batch_size: int) -> float:
    """Mean token loss of `rp` over the first MAX_EVAL_BLOCKS sequences of `valid`.

    Call with the weights synchronized (`rp.synchronize()`): it reads the model copy.
    """
    from engine import RoundPipeRunConfig
    from engine.models import causal_lm_loss

    count = min(len(valid), MAX_EVAL_BLOCKS)
    # The forward returns full logits to the host: bound them to ~_EVAL_LOGITS elements.
    per_row = valid.seq_len * vocab_size
    rows = max(1, min(batch_size, _EVAL_LOGITS // per_row))
    total, tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, count, rows):
            idx = torch.arange(start, min(start + rows, count))
            input_ids, labels, _ = valid.batch(idx)
            # the last chunk may have fewer rows than the run's micro-batches
            config = RoundPipeRunConfig(num_microbatch=min(rp.num_microbatch, len(idx)))
            logits = rp(input_ids, roundpipe_run_config=config)
            total += float(causal_lm_loss(logits, labels, num_items_in_batch=1, shifted=True))
            tokens += int((labels != -100).sum())
    return total / max(tokens, 1)
