"""Accuracy of the compact host-memory mode (issue 35): a tiny Qwen3 trained for 300 steps
on the demo's generated stories, bf16 weights as their own masters with 8-bit moments,
against the fp32-master path (the same bf16 compute, fp32 masters and fp32 moments).

Both runs compute the forward and backward in bf16, as RoundPipe does on the GPUs with a bf16
model; only what the optimizer keeps differs, so the test measures the mode itself. The
README and docs/HOST_MEMORY_MODES.md quote what this measured.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import transformers

import engine.optim as eo
from rp_service.demo import synthetic_records

SEQ, BATCH, STEPS, TAIL = 64, 8, 300, 30
VOCAB = 256  # bytes
REL_BOUND = 0.01  # the 1%


def _tokens(records: list[dict[str, str]]) -> torch.Tensor:
    """The stories as bytes, cut into (n, SEQ) rows."""
    data = " ".join(r["text"] for r in records).encode()
    ids = torch.tensor(list(data), dtype=torch.long)
    return ids[: len(ids) // SEQ * SEQ].view(-1, SEQ)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        use_cache=False,
        tie_word_embeddings=True,
    )
    return transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _train(mode: str, train: torch.Tensor, valid: torch.Tensor) -> tuple[list[float], float]:
    model = _model()
    params = list(model.parameters())
    hyper = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.01}
    if mode.startswith("compact"):
        masters = params  # the bf16 weights are the masters
        opt = eo.Adam(params, decoupled_weight_decay=True, state_dtype=torch.uint8, **hyper)
    else:
        masters = [torch.nn.Parameter(p.detach().float()) for p in params]
        for m in masters:
            m.grad_dtype = torch.bfloat16  # the bf16 gradient, read in place
        opt = eo.Adam(masters, decoupled_weight_decay=True, **hyper)
    losses = []
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        rows = torch.randint(0, train.shape[0], (BATCH,), generator=gen)
        loss = _loss(model, train[rows])
        grads = torch.autograd.grad(loss, params)
        for m, g in zip(masters, grads, strict=True):
            m.grad = g
        opt.step()
        if not mode.startswith("compact"):
            with torch.no_grad():
                for p, m in zip(params, masters, strict=True):
                    p.copy_(m)
        losses.append(float(loss.detach()))
    with torch.no_grad():
        batches = range(0, valid.shape[0], BATCH)
        val = sum(float(_loss(model, valid[i : i + BATCH])) for i in batches) / len(batches)
    return losses, val


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, tuple[list[float], float]]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: more threads only cost on a loaded CI box
    eo.set_num_threads(1)
    try:
        train = _tokens(synthetic_records(2000))
        valid = _tokens(synthetic_records(64, valid=True))
        yield {mode: _train(mode, train, valid) for mode in ("fp32_master", "compact")}
    finally:
        torch.set_num_threads(threads)
        eo.set_num_threads(None)


def _final(losses: list[float]) -> float:
    return sum(losses[-TAIL:]) / TAIL


def test_the_run_learns(runs) -> None:
    losses, _ = runs["fp32_master"]
    assert _final(losses) < 0.5 * losses[0]


def test_compact_train_loss_within_one_percent(runs) -> None:
    ref, got = _final(runs["fp32_master"][0]), _final(runs["compact"][0])
    assert abs(got - ref) / ref < REL_BOUND, ("train", ref, got)  # measured: 0.352 vs 0.352


@pytest.mark.xfail(
    strict=True,
    reason="issue 35 not met yet: measured valid 0.353 (compact) vs 0.339 (fp32 master), "
    "+4.0%; over 4 seeds the 8-bit moments cost +2.2% on average and the bf16 stochastic "
    "rounding adds a 5.7% spread, while two fp32 runs differing only in rounding order "
    "already end 1.6% apart (docs/HOST_MEMORY_MODES.md)",
)
def test_compact_valid_loss_within_one_percent(runs) -> None:
    ref, got = runs["fp32_master"][1], runs["compact"][1]
    assert abs(got - ref) / ref < REL_BOUND, ("valid", ref, got)
