"""RoundPipe against plain PyTorch: losses, gradients, steps (sync and staleness-one async)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from engine import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from engine.batch import RoundPipePackedData, TensorChunkSpec

from ._models import make_batch, make_model

RTOL, ATOL = 1e-5, 1e-6

MIXED_PLAN = ModelExecutePlan.from_ranges(
    [range(0, 3), range(3, 5), range(5, 7)],
    [range(3, 5), range(1, 3), range(0, 1)],  # backward groups that cut inside forward group 0
)


def mse_over(num_microbatch: int):
    def loss_fn(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return ((out - label) ** 2).mean() / num_microbatch

    return loss_fn


def reference_grads(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def model_grads(rp: RoundPipe) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in rp.model.named_parameters()}


@pytest.mark.parametrize("num_microbatch", [1, 2, 4, 5])
@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("plan", ["auto", "mixed"])
def test_forward_backward_matches_plain_pytorch(
    num_devices: int, num_microbatch: int, grain: str, plan: str
) -> None:
    model = make_model().eval()  # dropout off: masks cannot match across micro-batch splits
    ref = copy.deepcopy(model)
    x, y = make_batch()
    expected_loss, expected = reference_grads(ref, x, y)
    cfg = RoundPipeRunConfig(
        num_microbatch=num_microbatch,
        recompute_grain=grain,
        execute_plan=MIXED_PLAN if plan == "mixed" else None,
    )
    rp = RoundPipe(model, model_run_config=cfg)
    loss = rp.forward_backward((x,), label=y, loss_fn=mse_over(num_microbatch))
    rp.synchronize()
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=ATOL)
    got = model_grads(rp)
    for name, g in expected.items():
        torch.testing.assert_close(got[name], g, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("num_microbatch", [1, 4])
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_forward_then_backward_matches_plain_pytorch(
    num_devices: int, num_microbatch: int, grain: str
) -> None:
    model = make_model().eval()
    ref = copy.deepcopy(model)
    x, y = make_batch()
    x_ref = x.clone().requires_grad_(True)
    x_rp = x.clone().requires_grad_(True)
    ref_loss = ((ref(x_ref) - y) ** 2).mean()
    ref_loss.backward()
    rp = RoundPipe(
        model,
        model_run_config=RoundPipeRunConfig(num_microbatch=num_microbatch, recompute_grain=grain),
    )
    out = rp(x_rp)
    loss = ((out - y) ** 2).mean()
    loss.backward()
    rp.synchronize()
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(x_rp.grad, x_ref.grad, rtol=RTOL, atol=ATOL)
    for (name, p), (_, q) in zip(rp.model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("num_microbatch", [1, 2, 4])
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_dropout_masks_replayed_in_recompute(num_microbatch: int, grain: str) -> None:
    """With dropout on, one device runs groups in a fixed order; the oracle runs the same
    order in plain PyTorch, so the masks (and the recompute's replayed masks) must agree."""
    from .conftest import use_devices

    gen = use_devices("cpu:1", 1)
    next(gen)
    try:
        model = make_model(p_drop=0.3).train()
        ref = copy.deepcopy(model)
        x, y = make_batch()
        plan = MIXED_PLAN
        cfg = RoundPipeRunConfig(
            num_microbatch=num_microbatch, recompute_grain=grain, execute_plan=plan
        )
        rp = RoundPipe(model, model_run_config=cfg)
        torch.manual_seed(123)
        loss = rp.forward_backward((x,), label=y, loss_fn=mse_over(num_microbatch))
        rp.synchronize()
        # Oracle: group-major order over micro-batches, as one device executes it.
        torch.manual_seed(123)
        chunks = list(
            zip(
                torch.tensor_split(x, num_microbatch),
                torch.tensor_split(y, num_microbatch),
                strict=True,
            )
        )
        acts = [c[0] for c in chunks]
        layers = list(ref.children())
        for rng in plan.fwd_plan:
            acts = [nn.Sequential(*layers[rng.start : rng.stop])(a) for a in acts]
        ref_loss = sum(
            ((a - c[1]) ** 2).mean() / num_microbatch for a, c in zip(acts, chunks, strict=True)
        )
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
        for (name, p), (_, q) in zip(
            rp.model.named_parameters(), ref.named_parameters(), strict=True
        ):
            torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=name)
    finally:
        next(gen, None)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [make_batch(seed=100 + k) for k in range(n)]


def _accumulate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_microbatch: int) -> None:
    """Plain PyTorch gradient accumulation over the same micro-batches.

    Adam turns the rounding noise of a near-zero gradient entry into a full step, so the
    step oracles sum the gradients in the micro-batch order RoundPipe uses."""
    for xs, ys in zip(
        torch.tensor_split(x, num_microbatch), torch.tensor_split(y, num_microbatch), strict=True
    ):
        (((model(xs) - ys) ** 2).mean() / num_microbatch).backward()


def test_sync_steps_match_plain_adamw(num_devices: int) -> None:
    model = make_model().eval()
    ref = copy.deepcopy(model)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=4))
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)

    def step_fn() -> None:
        opt.step()
        opt.zero_grad()

    for x, y in _batches(5):
        rp.forward_backward((x,), label=y, loss_fn=mse_over(4))
        rp.step(step_fn, is_async=False)
        ref_opt.zero_grad()
        _accumulate(ref, x, y, 4)
        ref_opt.step()
    rp.synchronize()
    for (name, p), (_, q) in zip(rp.model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=name)


def test_async_steps_have_staleness_exactly_one(num_devices: int) -> None:
    model = make_model().eval()
    ref = copy.deepcopy(model)
    scratch = copy.deepcopy(model)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=4))
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-2)

    def step_fn() -> None:
        # parameters() inside step_fn are the optimizer-side tensors
        assert all(
            p is q for p, q in zip(rp.parameters(), opt.param_groups[0]["params"], strict=True)
        )
        opt.step()
        opt.zero_grad()

    batches = _batches(6)
    for x, y in batches:
        rp.forward_backward((x,), label=y, loss_fn=mse_over(4))
        rp.step(step_fn)
    rp.synchronize()

    # The loop written out: w[k+1] = update(w[k], grad L_k(w[k-1])), w[-1] = w[0].
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    prev = [p.detach().clone() for p in ref.parameters()]
    for x, y in batches:
        with torch.no_grad():
            for s, w in zip(scratch.parameters(), prev, strict=True):
                s.copy_(w)
        scratch.zero_grad()
        _accumulate(scratch, x, y, 4)
        prev = [p.detach().clone() for p in ref.parameters()]
        for p, s in zip(ref.parameters(), scratch.parameters(), strict=True):
            p.grad = s.grad.clone()
        ref_opt.step()
        ref_opt.zero_grad()
    for (name, p), (_, q) in zip(rp.model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=name)


def test_gradients_accumulate_across_calls(cpu3: int) -> None:
    model = make_model().eval()
    ref = copy.deepcopy(model)
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    x1, y1 = make_batch(seed=5)
    x2, y2 = make_batch(seed=6)
    rp.forward_backward((x1,), label=y1, loss_fn=mse_over(2))
    rp.forward_backward((x2,), label=y2, loss_fn=mse_over(2))
    rp.synchronize()
    (((ref(x1) - y1) ** 2).mean() + ((ref(x2) - y2) ** 2).mean()).backward()
    for (name, p), (_, q) in zip(rp.model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=name)


def test_tied_weights_accumulate(cpu3: int) -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(11, 6)
    head = nn.Linear(6, 11, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), head)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 11, (8, 3))
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=4))

    def ce(out: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.flatten(0, 1), lab.flatten()) / 4

    loss = rp.forward_backward((ids,), label=ids, loss_fn=ce)
    rp.synchronize()
    ref_loss = nn.functional.cross_entropy(ref(ids).flatten(0, 1), ids.flatten())
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(model[0].weight.grad, ref[0].weight.grad, rtol=RTOL, atol=ATOL)


def test_forward_no_grad_outputs_and_merge(num_devices: int) -> None:
    model = make_model().eval()
    ref = copy.deepcopy(model)
    x, _ = make_batch()
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=4))
    with torch.no_grad():
        expected = ref(x)
        out = rp(x)
        assert not out.requires_grad
        torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
        out = rp(x, roundpipe_run_config=RoundPipeRunConfig(output_device="cpu", num_microbatch=5))
        assert out.device.type == "cpu"
        torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
        packed = rp(x, roundpipe_run_config=RoundPipeRunConfig(merge_output=False))
        assert isinstance(packed, RoundPipePackedData) and len(packed) == 4
        torch.testing.assert_close(torch.cat(list(packed)), expected, rtol=RTOL, atol=ATOL)
        summed = rp(
            x,
            roundpipe_run_config=RoundPipeRunConfig(
                merge_output=lambda outs: sum(o.sum() for o in outs)
            ),
        )
        torch.testing.assert_close(summed, expected.sum(), rtol=RTOL, atol=1e-4)
        spec = rp(x, roundpipe_run_config=RoundPipeRunConfig(merge_output=TensorChunkSpec(0)))
        torch.testing.assert_close(spec, expected, rtol=RTOL, atol=ATOL)


def test_packed_output_feeds_the_next_model(cpu3: int) -> None:
    first, second = make_model(seed=1).eval(), make_model(seed=2).eval()
    second = nn.Sequential(nn.Linear(4, 16), *list(second.children())[1:])
    ref1, ref2 = copy.deepcopy(first), copy.deepcopy(second)
    x, _ = make_batch()
    a = RoundPipe(first, model_run_config=RoundPipeRunConfig(num_microbatch=4, merge_output=False))
    b = RoundPipe(second, model_run_config=RoundPipeRunConfig(num_microbatch=4))
    with torch.no_grad():
        torch.testing.assert_close(b(a(x)), ref2(ref1(x)), rtol=RTOL, atol=ATOL)


def test_kwargs_and_replicated_inputs(cpu3: int) -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, *, factor: float, bias: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * factor + bias

    torch.manual_seed(0)
    model = nn.Sequential(Scale(), nn.ReLU(), nn.Linear(4, 2))
    ref = copy.deepcopy(model)
    x = torch.randn(6, 4)
    bias = torch.randn(4)  # not batched: replicated to every micro-batch
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=3))
    with torch.no_grad():
        out = rp(x, factor=2.0, bias=bias)
        expected = ref[2](ref[1](ref[0](x, factor=2.0, bias=bias)))
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)


def test_save_for_recompute_round_trip(cpu3: int) -> None:
    from engine import doing_recompute, get_recompute_data, save_for_recompute

    seen: list[float] = []

    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if doing_recompute():
                (noise,) = get_recompute_data()
                seen.append(float(noise.sum()))
            else:
                noise = torch.rand_like(x)  # regenerated noise would differ; saved noise must not
                save_for_recompute(noise)
            return self.lin(x) + noise

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Noisy(), nn.Linear(4, 1))
    rp = RoundPipe(
        model,
        model_run_config=RoundPipeRunConfig(
            num_microbatch=2,
            preserve_rng_state=False,
            execute_plan=ModelExecutePlan.from_ranges([range(0, 2), range(2, 3)], [range(0, 2)]),
        ),
    )
    x = torch.randn(4, 4)
    rp.forward_backward((x,), label=None, loss_fn=lambda out, _: out.sum())
    assert len(seen) == 2  # the backward recompute ran Noisy once per micro-batch with saved data


class _AddInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + y


def test_split_specs_callables_and_requires_grad(cpu3: int) -> None:
    from engine.batch import _Replicate

    torch.manual_seed(0)
    model = nn.Sequential(_AddInputs(), nn.Linear(4, 2))
    ref = copy.deepcopy(model)
    x, y, y_row = torch.randn(6, 4), torch.randn(6, 4), torch.randn(1, 4)
    rp = RoundPipe(model)
    with torch.no_grad():
        # chunk specs of torch.distributed.pipelining: split x, give every micro-batch y_row
        spec = ((TensorChunkSpec(0), _Replicate), {})
        out = rp(
            x, y_row, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=3, split_input=spec)
        )
        torch.testing.assert_close(out, ref[1](ref[0](x, y_row)), rtol=RTOL, atol=ATOL)

        def splitter(args: tuple, kwargs: dict, n: int) -> list:
            pairs = zip(torch.tensor_split(args[0], n), torch.tensor_split(args[1], n), strict=True)
            return [((a, b), {}) for a, b in pairs]

        out = rp(
            x, y, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=2, split_input=splitter)
        )
        torch.testing.assert_close(out, ref[1](ref[0](x, y)), rtol=RTOL, atol=ATOL)
    label = torch.randn(6, 2)
    loss = rp.forward_backward(
        (x, y),
        label=label,
        loss_fn=lambda o, lab: ((o - lab) ** 2).sum(),
        run_config=RoundPipeRunConfig(
            num_microbatch=3, split_label=lambda lab, n: list(torch.tensor_split(lab, n))
        ),
    )
    torch.testing.assert_close(
        loss, ((ref[1](ref[0](x, y)) - label) ** 2).sum().detach(), rtol=RTOL, atol=ATOL
    )
    out = rp(x, y, roundpipe_run_config=RoundPipeRunConfig(requires_grad=False))
    assert not out.requires_grad  # no graph kept although gradients are enabled


def test_call_state_is_freed_without_the_cycle_collector(num_devices: int) -> None:
    """A finished call drops its activations at once: held by a reference cycle they
    would live until the cycle collector runs, and on CUDA every iteration would then
    pin fresh host memory (cudaHostAlloc blocks the issuing thread for tens of ms)."""
    import gc

    from engine.run_state import RunState

    rp = RoundPipe(make_model().eval(), model_run_config=RoundPipeRunConfig(num_microbatch=2))
    x, y = make_batch()
    gc.collect()
    gc.disable()
    try:
        rp.forward_backward((x,), label=y, loss_fn=mse_over(2))
        out = rp(x)
        out.sum().backward()
        del out
        alive = [o for o in gc.get_objects() if type(o) is RunState]
    finally:
        gc.enable()
    assert alive == []
