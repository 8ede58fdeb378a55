"""Outputs kept per micro-batch (merge_output=False) feeding another RoundPipe, with the
gradients flowing back through both; reducers in merge_output specs (avg_reducer, torch's
sum_reducer) folded over the micro-batches, forward and backward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from engine import RoundPipe, RoundPipeRunConfig
from engine.batch import AvgReducer, RoundPipePackedData, avg_reducer, sum_reducer
from engine.errors import ConfigError

MB = 3
PACKED = RoundPipeRunConfig(num_microbatch=MB, merge_output=False)


class SquareMean(nn.Module):
    """A head that returns one scalar per call: each micro-batch's mean square."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.square().mean()


def _pair() -> tuple[nn.Sequential, nn.Sequential]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh()), nn.Sequential(nn.Linear(6, 2))


def _grads(*models: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for m in models for p in m.parameters()]


def test_a_packed_output_chains_into_another_model_and_back(num_devices: int) -> None:
    first, second = _pair()
    ref_first, ref_second = copy.deepcopy(first), copy.deepcopy(second)
    a = RoundPipe(first, model_run_config=RoundPipeRunConfig(num_microbatch=MB))
    b = RoundPipe(second, model_run_config=RoundPipeRunConfig(num_microbatch=MB))
    x = torch.randn(9, 4, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    packed = a(x, roundpipe_run_config=PACKED)
    assert isinstance(packed, RoundPipePackedData) and len(packed) == MB
    assert all(t.requires_grad for t in packed)
    out = b(packed)
    out.square().sum().backward()
    a.synchronize()
    b.synchronize()
    ref_second(ref_first(x_ref)).square().sum().backward()
    for got, want in zip(_grads(first, second), _grads(ref_first, ref_second), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)


def test_forward_backward_of_a_packed_input_trains_the_model_before(cpu3: int) -> None:
    first, second = _pair()
    ref_first, ref_second = copy.deepcopy(first), copy.deepcopy(second)
    a = RoundPipe(first, model_run_config=RoundPipeRunConfig(num_microbatch=MB))
    b = RoundPipe(second, model_run_config=RoundPipeRunConfig(num_microbatch=MB))
    x = torch.randn(9, 4)
    loss = b.forward_backward(
        input_args=(a(x, roundpipe_run_config=PACKED),),
        loss_fn=lambda out, label: out.square().sum(),
    )
    a.synchronize()
    b.synchronize()
    want = ref_second(ref_first(x)).square().sum()
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-5)
    for got, ref in zip(_grads(first, second), _grads(ref_first, ref_second), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reducer", ["avg", "sum"])
def test_a_reducer_folds_the_micro_batches_forward_and_backward(reducer: str, cpu3: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SquareMean())
    ref = copy.deepcopy(model)
    spec = avg_reducer if reducer == "avg" else sum_reducer
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=MB))
    x = torch.randn(9, 4)
    out = rp(x, roundpipe_run_config=RoundPipeRunConfig(merge_output=spec))
    assert out.dim() == 0  # folded, not stacked
    out.backward()
    rp.synchronize()
    parts = torch.stack([ref(xm) for xm in x.chunk(MB)])
    want = parts.mean() if reducer == "avg" else parts.sum()
    want.backward()
    torch.testing.assert_close(out.detach(), want.detach())
    for got, ref_grad in zip(_grads(model), _grads(ref), strict=True):
        torch.testing.assert_close(got, ref_grad, rtol=1e-5, atol=1e-6)


def test_a_custom_reducer_folds_but_carries_no_gradient(cpu3: int) -> None:
    from torch.distributed.pipelining.microbatch import _CustomReducer

    largest = _CustomReducer(torch.tensor(float("-inf")), torch.maximum)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SquareMean())
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=MB))
    x = torch.randn(9, 4)
    cfg = RoundPipeRunConfig(merge_output=largest)
    with torch.no_grad():
        got = rp(x, roundpipe_run_config=cfg)
        want = max(model(xm) for xm in x.chunk(MB))
    torch.testing.assert_close(got, want)
    with pytest.raises(ConfigError, match="custom reducer"):
        rp(x, roundpipe_run_config=cfg)


def test_an_avg_reducer_folds_one_reduction_at_a_time() -> None:
    reducer = AvgReducer()
    mean = reducer.reduce(None, torch.tensor(1.0))
    mean = reducer.reduce(mean, torch.tensor(3.0))
    assert float(mean) == 2.0 and reducer.count == 2
    other = reducer.reduce(None, torch.tensor(5.0))  # None starts over
    assert float(other) == 5.0 and reducer.count == 1
    with pytest.raises(AssertionError, match="one AvgReducer"):
        reducer.reduce(mean, torch.tensor(1.0))  # a fold that another one interrupted


def test_a_packed_input_among_other_arguments_is_refused(cpu3: int) -> None:
    first, second = _pair()
    a = RoundPipe(first, model_run_config=RoundPipeRunConfig(num_microbatch=MB))
    b = RoundPipe(second, model_run_config=RoundPipeRunConfig(num_microbatch=MB))
    with torch.no_grad():
        packed = a(torch.randn(9, 4), roundpipe_run_config=PACKED)
        with pytest.raises(ConfigError, match="only input"):
            b(packed, torch.ones(9))


class Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x.square()


class Join(nn.Linear):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        return super().forward(pair[0] + pair[1])


def test_packed_tuple_outputs_carry_every_gradient(cpu3: int) -> None:
    """A micro-batch's output may be a tuple: each of its tensors gets its gradient."""
    torch.manual_seed(0)
    first, second = nn.Sequential(nn.Linear(4, 6), Pair()), nn.Sequential(Join(6, 2))
    ref_first, ref_second = copy.deepcopy(first), copy.deepcopy(second)
    a = RoundPipe(first, model_run_config=RoundPipeRunConfig(num_microbatch=MB))
    b = RoundPipe(second, model_run_config=RoundPipeRunConfig(num_microbatch=MB))
    x = torch.randn(9, 4)
    packed = a(x, roundpipe_run_config=PACKED)
    assert all(isinstance(out, tuple) and out[1].requires_grad for out in packed)
    b(packed).sum().backward()
    a.synchronize()
    b.synchronize()
    ref_second(ref_first(x)).sum().backward()
    for got, ref in zip(_grads(first, second), _grads(ref_first, ref_second), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
