"""The validation loss: every sequence counted once, whatever the last chunk's rows against
the run's micro-batches (a chunk of 2 rows under num_microbatch 4 used to be refused)."""

from __future__ import annotations

import torch

from engine import RoundPipeRunConfig, wrap_model_to_roundpipe
from engine.models import causal_lm_loss
from rp_service.data.datasets import TokenBlocks
from rp_service.worker.evaluation import evaluate
from tests.unit.engine.models.test_models import tiny_model


def test_a_short_last_chunk_is_evaluated_too() -> None:
    model = tiny_model("qwen3", layers=2).eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, int(model.config.vocab_size), (6, 9), generator=g, dtype=torch.int32)
    labels = ids.clone()
    labels[:, :2] = -100
    valid = TokenBlocks(input_ids=ids, labels=labels, tokens=torch.full((6,), 9))
    with torch.no_grad():
        logits = model(input_ids=ids.long()).logits
        want = float(causal_lm_loss(logits, labels.long(), num_items_in_batch=1, shifted=True))
    want /= int((labels != -100).sum())
    rp = wrap_model_to_roundpipe(
        model, optim_dtype=torch.float32, model_run_config=RoundPipeRunConfig(num_microbatch=4)
    )
    got = evaluate(rp, valid, vocab_size=int(model.config.vocab_size), batch_size=4)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
