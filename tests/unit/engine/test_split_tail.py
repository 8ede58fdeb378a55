"""The fused tail split over several jobs (ModelExecutePlan.tail_split): same results as one
job, on eight and on three virtual devices, and the plan/simulation that choose it.

Oracle: the HF model (fp32, CPU) on the same weights, and RoundPipe with the tail as one
job; losses, gradients (the tied embedding included: the head's share of its gradient is
summed over the tail's jobs) and the weights after three AdamW steps agree at rtol 1e-5.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from engine import ModelExecutePlan, RoundPipeRunConfig
from engine.errors import ConfigError
from engine.models import count_loss_tokens
from engine.planning.simulate import pipeline_makespan, simulate_plan
from engine.scheduler import plan_from_times
from engine.wrapper import wrap_model_to_roundpipe
from tests.tiny_models import tiny_model

from .conftest import use_devices

transformers = pytest.importorskip("transformers")

RTOL, ATOL = 1e-5, 1e-6
VOCAB, ROWS, SEQ = 96, 8, 7


@pytest.fixture
def cpu8() -> Iterator[int]:
    yield from use_devices("cpu:8", 8)


def tiny_qwen3() -> torch.nn.Module:
    """A 2-decoder-layer Qwen3 with tied embeddings, fp32."""
    return tiny_model(
        "qwen3", vocab_size=VOCAB, max_position_embeddings=32, tie_word_embeddings=True
    )


def batch(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # padding in some rows: micro-batches count different loss tokens
    mask[6, 4:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def split_plan(split: int) -> ModelExecutePlan:
    # [embedding, decoder 0, decoder 1, head]: the tail is decoder 1 + head
    return ModelExecutePlan.from_ranges(
        [range(0, 1), range(1, 2), range(2, 4)], [range(1, 2), range(0, 1)], split
    )


def train(model: torch.nn.Module, split: int, grain: str, *, is_async: bool) -> dict[str, Any]:
    rp = wrap_model_to_roundpipe(
        model,
        use_sequential_preset=True,
        model_run_config=RoundPipeRunConfig(
            num_microbatch=ROWS, recompute_grain=grain, execute_plan=split_plan(split)
        ),
    )
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-3, weight_decay=0.1)

    def step_fn() -> None:
        opt.step()
        opt.zero_grad()

    losses, grads, logits = [], {}, None
    for step in range(3):
        kwargs = batch(10 + step)
        kwargs["num_items_in_batch"] = count_loss_tokens(kwargs["labels"])
        loss, out = rp.forward_backward(
            input_kwargs={**kwargs, "return_logits": True},
            loss_fn=lambda out, _: out.loss,
            return_outputs=True,
        )
        losses.append(loss.detach())
        if step == 0:
            rp.synchronize()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            logits = out.logits
        rp.step(step_fn, is_async=is_async)
    rp.synchronize()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "weights": weights, "logits": logits}


def hf_reference(model: torch.nn.Module) -> dict[str, Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses, grads, logits = [], {}, None
    for step in range(3):
        out = model(**batch(10 + step))
        out.loss.backward()
        losses.append(out.loss.detach())
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            logits = out.logits.detach()
        opt.step()
        opt.zero_grad()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "weights": weights, "logits": logits}


def assert_same(got: dict[str, Any], expected: dict[str, Any]) -> None:
    for a, b in zip(got["losses"], expected["losses"], strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got["logits"], expected["logits"], rtol=RTOL, atol=ATOL)
    for name, g in expected["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, rtol=RTOL, atol=ATOL, msg=name)
    for name, w in expected["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, rtol=RTOL, atol=1e-5, msg=name)


@pytest.mark.parametrize("split", [2, 3, 8])
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_split_tail_trains_like_hf_on_eight_devices(cpu8: int, split: int, grain: str) -> None:
    ref = tiny_qwen3()
    got = train(copy.deepcopy(ref), split, grain, is_async=False)
    assert_same(got, hf_reference(ref))


def test_split_tail_on_fewer_devices_than_jobs(cpu3: int) -> None:
    """Four tail jobs on three devices: two of them share a device (and its replica)."""
    ref = tiny_qwen3()
    got = train(copy.deepcopy(ref), 4, "stage", is_async=False)
    assert_same(got, hf_reference(ref))


def test_split_tail_keeps_the_asynchronous_step(cpu8: int) -> None:
    """Staleness one: the split run's losses and weights are the one-job run's."""
    ref = tiny_qwen3()
    one = train(copy.deepcopy(ref), 1, "stage", is_async=True)
    split = train(copy.deepcopy(ref), 3, "stage", is_async=True)
    assert_same(split, one)


def test_more_tail_jobs_than_micro_batches_is_clamped(cpu8: int) -> None:
    ref = tiny_qwen3()
    mine = copy.deepcopy(ref)
    rp = wrap_model_to_roundpipe(
        mine,
        use_sequential_preset=True,
        model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=split_plan(8)),
    )
    kwargs = batch(3)
    kwargs["num_items_in_batch"] = count_loss_tokens(kwargs["labels"])
    loss = rp.forward_backward(input_kwargs=kwargs, loss_fn=lambda out, _: out.loss)
    expected = ref(**batch(3))
    expected.loss.backward()
    rp.synchronize()
    torch.testing.assert_close(loss, expected.loss.detach(), rtol=RTOL, atol=ATOL)
    for name, p in ref.named_parameters():
        got = dict(mine.named_parameters())[name].grad
        torch.testing.assert_close(got, p.grad, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_tail_split_is_refused(bad: Any) -> None:
    plan = split_plan(1)
    plan.tail_split = bad
    with pytest.raises(ConfigError, match="tail_split"):
        plan.check_valid(4, "fused")


def test_makespan_of_a_split_job_by_hand() -> None:
    # forward 1, tail 4, backward 1 per micro-batch; 3 devices, 2 micro-batches, no handoff.
    # One tail job: tail mb0 1..5, mb1 5..9; backward mb0 5..6, mb1 9..10.
    assert pipeline_makespan([1.0, 4.0, 1.0], 3, 2) == 10.0
    # Two: mb0 on device 1 (1..5), mb1 on device 2 (2..6); backward on device 0: 5..6, 6..7.
    assert pipeline_makespan([1.0, 4.0, 1.0], 3, 2, split_job=1, split=2) == 7.0


# Per-layer times (ms over 16 micro-batches) measured on one H100 for Qwen3-1.7B:
# embedding, 28 decoder layers, the head with its loss (bench/RESULTS.md, issue 20).
H100_FWD = [25.0] + [30.0] * 28 + [143.7]
H100_BWD = [59.5] + [77.0] * 28 + [453.5]


def test_planner_splits_the_tail_where_it_is_longer_than_a_share() -> None:
    mem = [0.01] * len(H100_FWD)
    plan = plan_from_times("fused", H100_FWD, H100_BWD, mem, num_devices=8, num_microbatch=16)
    plan.check_valid(len(H100_FWD), "fused")
    assert plan.tail_split > 1
    one = ModelExecutePlan.from_ranges(plan.fwd_plan, plan.bwd_plan, 1)
    assert simulate_plan(plan, H100_FWD, H100_BWD, 8, 16) < simulate_plan(
        one, H100_FWD, H100_BWD, 8, 16
    )
    # one device runs every job in turn: nothing to split
    single = plan_from_times("fused", H100_FWD, H100_BWD, mem, num_devices=1, num_microbatch=16)
    assert single.tail_split == 1


def test_tail_jobs_take_interleaved_micro_batches_on_their_own_devices(
    cpu8: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import engine.roundpipe as roundpipe_module
    from engine import run as run_module

    seen: list[tuple[int, int, list[int]]] = []

    def recording_fused_job(dev: Any, run: Any, part: int = 0) -> None:
        seen.append((dev.id, part, list(run.tail_micro_batches(part))))
        run_module.fused_job(dev, run, part)

    monkeypatch.setattr(roundpipe_module, "fused_job", recording_fused_job)
    ref = tiny_qwen3()
    train(copy.deepcopy(ref), 3, "stage", is_async=False)
    first_call = sorted(seen[:3], key=lambda job: job[1])  # device threads start in any order
    assert [p for _, p, _ in first_call] == [0, 1, 2]
    assert [mbs for _, _, mbs in first_call] == [[0, 3, 6], [1, 4, 7], [2, 5]]
    assert len({d for d, _, _ in first_call}) == 3  # three devices


def test_two_devices_never_split_the_tail() -> None:
    """A split changes the order of the head's gradient sums (last bits of fp16 weights);
    plans follow measured times, so 1-2 GPU runs keep one tail job and stay reproducible."""
    mem = [0.01] * len(H100_FWD)
    for m in (2, 4, 8, 16):
        plan = plan_from_times("fused", H100_FWD, H100_BWD, mem, num_devices=2, num_microbatch=m)
        assert plan.tail_split == 1
