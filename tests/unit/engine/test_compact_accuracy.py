"""Accuracy of the compact host-memory mode (issue 35): a tiny Qwen3 trained for 300 steps
on the demo's generated stories, bf16 weights as their own masters with 8-bit moments,
against the fp32-master path (the same bf16 compute, fp32 masters and fp32 moments).

Both runs compute the forward and backward in bf16, as RoundPipe does on the GPUs with a bf16
model; only what the optimizer keeps differs, so the test measures the mode itself. One
run's loss lands 2-4% from another's that differs by a rounding, so the bounds apply to
the mean over SEEDS (each seed: the initialisation and the batch order). The README and
docs/HOST_MEMORY_MODES.md quote what this measured.
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
REL_BOUND = 0.01  # the 1%, on the mean over the seeds
# Six seeds is what ~90 s of CI allows; their mean still has a ~1.5% standard error
# (docs/HOST_MEMORY_MODES.md: 16 seeds measured -0.6% train, -0.5% valid).
SEEDS = tuple(range(6))


def _tokens(records: list[dict[str, str]]) -> torch.Tensor:
    """The stories as bytes, cut into (n, SEQ) rows."""
    data = " ".join(r["text"] for r in records).encode()
    ids = torch.tensor(list(data), dtype=torch.long)
    return ids[: len(ids) // SEQ * SEQ].view(-1, SEQ)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
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


def _train(
    mode: str, train: torch.Tensor, valid: torch.Tensor, seed: int = 0
) -> tuple[list[float], float]:
    """One run; `seed` picks the initialisation and the batch order."""
    model = _model(seed)
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
    gen = torch.Generator().manual_seed(1 + seed)
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
def runs() -> Iterator[dict[str, list[tuple[list[float], float]]]]:
    """Each mode's runs, one per seed of SEEDS."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: more threads only cost on a loaded CI box
    eo.set_num_threads(1)
    try:
        train = _tokens(synthetic_records(2000))
        valid = _tokens(synthetic_records(64, valid=True))
        yield {
            mode: [_train(mode, train, valid, seed) for seed in SEEDS]
            for mode in ("fp32_master", "compact")
        }
    finally:
        torch.set_num_threads(threads)
        eo.set_num_threads(None)


def _final(losses: list[float]) -> float:
    return sum(losses[-TAIL:]) / TAIL


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_the_run_learns(runs) -> None:
    for losses, _ in runs["fp32_master"]:
        assert _final(losses) < 0.5 * losses[0]


def test_compact_train_loss_within_one_percent(runs) -> None:
    ref = _mean([_final(losses) for losses, _ in runs["fp32_master"]])
    got = _mean([_final(losses) for losses, _ in runs["compact"]])
    assert abs(got - ref) / ref < REL_BOUND, ("train", ref, got)  # measured: -0.5%


def test_compact_valid_loss_within_one_percent(runs) -> None:
    ref = _mean([val for _, val in runs["fp32_master"]])
    got = _mean([val for _, val in runs["compact"]])
    assert abs(got - ref) / ref < REL_BOUND, ("valid", ref, got)  # measured: -0.8%
