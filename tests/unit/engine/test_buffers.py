"""Module buffers a layer writes in its forward come back to the host (the seeds' user guide:
a standalone buffer "can be written safely"), whether the write is a Python in-place op or a
kernel that leaves the version counter alone (BatchNorm's running statistics)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from engine import ModelExecutePlan, RoundPipe, RoundPipeRunConfig

NUM_MICROBATCH = 3


class Accumulate(nn.Module):
    """The seeds' example: a linear layer whose standalone buffer sums what it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("acc", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.acc.add_(x.detach().sum(0))
        return self.linear(x)


def _bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))


def _batches(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(9, 4, generator=gen) * 3 + 5 for _ in range(n)]


def _loss(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _run_plain(model: nn.Module, batches: list[torch.Tensor]) -> None:
    """What the engine computes: each micro-batch through the model in turn."""
    for x in batches:
        for xm in x.chunk(NUM_MICROBATCH):
            _loss(model(xm), xm).backward()


def test_a_python_write_to_a_standalone_buffer_comes_back(num_devices: int) -> None:
    model = nn.Sequential(Accumulate(), nn.ReLU(), Accumulate())
    ref = copy.deepcopy(model)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH))
    batches = _batches(2)
    for x in batches:
        rp.forward_backward((x,), label=x, loss_fn=_loss)
    rp.synchronize()
    with torch.no_grad():
        for x in batches:
            ref(x)
    for i in (0, 2):
        torch.testing.assert_close(model[i].acc, ref[i].acc)
        assert model[i].acc.abs().sum() > 0


def test_batchnorm_running_statistics_come_back(num_devices: int) -> None:
    model = _bn_model()
    ref = copy.deepcopy(model)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH))
    batches = _batches(3)
    for x in batches:
        rp.forward_backward((x,), label=x, loss_fn=_loss)
    rp.synchronize()
    _run_plain(ref, batches)
    bn, ref_bn = model[1], ref[1]
    assert not torch.equal(bn.running_mean, torch.zeros(6))  # the kernel's writes came back
    torch.testing.assert_close(bn.running_mean, ref_bn.running_mean)
    torch.testing.assert_close(bn.running_var, ref_bn.running_var)
    assert int(bn.num_batches_tracked) == 3 * NUM_MICROBATCH
    # and evaluation then normalises with them, as the plain model does
    rp.eval()
    ref.eval()
    x = _batches(4)[-1]
    with torch.no_grad():
        torch.testing.assert_close(rp(x), ref(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("training", [True, False])
def test_a_no_grad_forward_updates_them_only_in_training(training: bool, cpu3: int) -> None:
    model = _bn_model()
    ref = copy.deepcopy(model)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH))
    rp.train(training)
    ref.train(training)
    before = model[1].running_mean.clone()
    x = _batches(1)[0]
    with torch.no_grad():
        rp(x)
        for xm in x.chunk(NUM_MICROBATCH):
            ref(xm)
    torch.testing.assert_close(model[1].running_mean, ref[1].running_mean)
    torch.testing.assert_close(model[1].running_var, ref[1].running_var)
    assert torch.equal(model[1].running_mean, before) != training


# The head's group split over three jobs, one per device, each running its micro-batches.
SPLIT_TAIL = ModelExecutePlan.from_ranges([range(0, 1), range(1, 4)], [range(0, 1)], tail_split=3)


def test_a_tail_with_batchnorm_is_not_split(cpu3: int) -> None:
    """Split jobs would each update their own copy of the running statistics, and the last
    download would win: the tail runs in one job instead (same results otherwise)."""
    model = _bn_model()
    ref = copy.deepcopy(model)
    cfg = RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH, execute_plan=SPLIT_TAIL)
    rp = RoundPipe(model, model_run_config=cfg)
    batches = _batches(3)
    for x in batches:
        rp.forward_backward((x,), label=x, loss_fn=_loss)
    rp.synchronize()
    _run_plain(ref, batches)
    torch.testing.assert_close(model[1].running_mean, ref[1].running_mean)
    torch.testing.assert_close(model[1].running_var, ref[1].running_var)


def test_a_tail_seen_writing_a_buffer_is_not_split_again(cpu3: int) -> None:
    """A Python write shows at the first call's download (the automatic plan never splits
    the tail before it has measured one); from then on the tail runs in one job."""
    model = nn.Sequential(nn.Linear(4, 4), Accumulate(), nn.ReLU(), Accumulate())
    ref = copy.deepcopy(model)
    cfg = RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH, execute_plan=SPLIT_TAIL)
    rp = RoundPipe(model, model_run_config=cfg)
    batches = _batches(3)
    rp.forward_backward((batches[0],), label=batches[0], loss_fn=_loss)
    rp.synchronize()
    after_first = [model[i].acc.clone() for i in (1, 3)]
    for x in batches[1:]:
        rp.forward_backward((x,), label=x, loss_fn=_loss)
    rp.synchronize()
    with torch.no_grad():
        for x in batches[1:]:
            for xm in x.chunk(NUM_MICROBATCH):
                ref(xm)
    for got, first, want in zip((model[1], model[3]), after_first, (ref[1], ref[3]), strict=True):
        torch.testing.assert_close(got.acc - first, want.acc)


def test_the_device_copies_follow_train_and_eval(cpu3: int) -> None:
    """The layers' device copies are made once: eval() after a training call must still
    turn their dropout off (and train() on again)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    ref = copy.deepcopy(model).eval()
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH))
    x = _batches(1)[0]
    for _ in range(3):  # every device gets its copies, in training mode
        rp.forward_backward((x,), label=x, loss_fn=_loss)
    rp.synchronize()
    rp.eval()
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(rp(x), ref(x))
    rp.train()
    with torch.no_grad():
        assert not torch.allclose(rp(x), ref(x))


def test_a_norm_in_eval_inside_a_training_model_keeps_its_statistics(cpu3: int) -> None:
    """Fine-tuning often freezes the norms' statistics (bn.eval() under model.train()):
    what counts is the norm's own mode, either way round, also inside a layer."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))  # one layer with a norm inside
    model = nn.Sequential(block, nn.ReLU(), nn.Linear(6, 2))
    bn = block[1]
    bn.eval()
    frozen = bn.running_mean.clone(), bn.running_var.clone()
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH))
    batches = _batches(2)
    for x in batches:
        rp.forward_backward((x,), label=x, loss_fn=_loss)
    rp.synchronize()
    assert torch.equal(bn.running_mean, frozen[0]) and torch.equal(bn.running_var, frozen[1])
    rp.eval()  # the other way round: the layer in eval, its norm still updating
    bn.train()
    with torch.no_grad():
        rp(batches[0])
    assert not torch.equal(bn.running_mean, frozen[0])
