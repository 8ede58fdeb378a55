"""Accuracy of the compact host-memory mode (issue 35): a tiny Qwen3 trained for 300 steps
on the demo's generated stories, bf16 weights as their own masters with 8-bit moments,
against the fp32-master path (the same bf16 compute, fp32 masters and fp32 moments).

Both runs compute the forward and backward in bf16, as RoundPipe does on the GPUs with a bf16
model; only what the optimizer keeps differs, so the test measures the mode itself. One
run's loss lands about 1% (train) and 2% (valid) from another's that differs by a rounding
at lr 1e-3 (3.6-3.8% at 3e-3, where six seeds drew +1.9% on one CPU and -0.6% on another),
so the bounds apply to the mean over SEEDS (each seed: the initialisation and the batch
order), run in two processes. docs/HOST_MEMORY_MODES.md has the measurements.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing

import pytest
import torch
import transformers

import engine.optim as eo
from rp_service.demo import synthetic_records

SEQ, BATCH, STEPS, TAIL = 64, 8, 300, 30
VOCAB = 256  # bytes
LR = 1e-3
REL_BOUND = 0.01  # the 1%, on the mean over the seeds
# Twelve seeds in two processes, ~80 s on 2 cores: their mean has a ~0.3% (train) and
# ~0.5% (valid) standard error (docs/HOST_MEMORY_MODES.md: 24 seeds measured -0.1% and +0.3%).
SEEDS = tuple(range(12))
PROCESSES = 2


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
    hyper = {"lr": LR, "betas": (0.9, 0.95), "weight_decay": 0.01}
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


def _train_seed(seed: int) -> dict[str, tuple[list[float], float]]:
    """Both modes at one seed, on one thread (a worker process's task)."""
    torch.set_num_threads(1)  # tiny model: more threads only cost on a loaded CI box
    eo.set_num_threads(1)
    train = _tokens(synthetic_records(2000))
    valid = _tokens(synthetic_records(64, valid=True))
    return {mode: _train(mode, train, valid, seed) for mode in ("fp32_master", "compact")}


@pytest.fixture(scope="module")
def runs() -> dict[str, list[tuple[list[float], float]]]:
    """Each mode's runs, one per seed of SEEDS (the seeds shared over PROCESSES)."""
    context = multiprocessing.get_context("spawn")  # no fork of a process with threads
    with concurrent.futures.ProcessPoolExecutor(PROCESSES, mp_context=context) as pool:
        by_seed = list(pool.map(_train_seed, SEEDS))
    return {mode: [seed_runs[mode] for seed_runs in by_seed] for mode in by_seed[0]}


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
    assert abs(got - ref) / ref < REL_BOUND, ("train", ref, got)  # measured: +0.1%


def test_compact_valid_loss_within_one_percent(runs) -> None:
    ref = _mean([val for _, val in runs["fp32_master"]])
    got = _mean([val for _, val in runs["compact"]])
    assert abs(got - ref) / ref < REL_BOUND, ("valid", ref, got)  # measured: +0.0%
