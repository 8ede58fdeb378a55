"""optim_memory='compact' publishes layer by layer (issue 35): the optimizer writes the
weights the next call uploads, and a layer's uploads start once engine.optim.Adam reports
the weights it owns updated (layer 0 first), not when the whole step_fn returns.

Oracle: the same steps with the layer-by-layer publishing off (the private switch
`_publish_as_updated`, the whole-step path): weights and optimizer state bit for bit.
"""

from __future__ import annotations

import copy
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import engine.optim as eo
from engine import ModelExecutePlan, RoundPipe, RoundPipeRunConfig, StepError
from engine.context import step_progress
from engine.roundpipe_base import _LayerProgress

from ._models import DIM, MLPBlock
from .conftest import use_devices

VOCAB = 37  # odd sizes: SIMD tails run
STEPS = 4
LAYERS = 5  # embedding, norm, two MLP blocks, head (tied to the embedding)
OWNERS = 4  # the layers that own a weight: the head's is the embedding's


class TiedHead(nn.Module):
    """The output projection, sharing the embedding's weight (tied embeddings)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.weight = embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()  # (mb, seq, vocab)


def _tied_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    embedding = nn.Embedding(VOCAB, DIM)
    model = nn.Sequential(
        embedding, nn.LayerNorm(DIM), MLPBlock(DIM, 0.0), MLPBlock(DIM, 0.0), TiedHead(embedding)
    )
    return model.bfloat16()


# A fixed plan of several layer groups: the upload of the head waits on the embedding's
# owner too (the tied weight), and equal plans sum the micro-batch gradients alike.
PLAN = ModelExecutePlan.from_ranges(
    [range(0, 2), range(2, 3), range(3, 5)], [range(2, 3), range(0, 2)]
)


def _rp(model: nn.Module, *, layer_by_layer: bool = True, pin_model: str = "off") -> RoundPipe:
    cfg = RoundPipeRunConfig(execute_plan=PLAN, num_microbatch=3)
    rp = RoundPipe(model, pin_model=pin_model, optim_memory="compact", model_run_config=cfg)
    object.__setattr__(rp, "_publish_as_updated", layer_by_layer)
    return rp


def _adam(rp: RoundPipe) -> eo.Adam:
    """Two groups, not in the model's order: the 1-d parameters (norms, biases) first."""
    params = list(rp.optim_parameters())
    flat = [p for p in params if p.ndim == 1]
    rest = [p for p in params if p.ndim != 1]
    return eo.Adam(
        [{"params": flat, "weight_decay": 0.0}, {"params": rest}],
        lr=1e-2,
        weight_decay=0.1,
        decoupled_weight_decay=True,
        state_dtype=torch.uint8,
    )


def _loss(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float().reshape(-1, VOCAB), label.reshape(-1))


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (6, 7), generator=g) for _ in range(n)]


def _train(rp: RoundPipe, opt: torch.optim.Optimizer, steps: int = STEPS) -> None:
    def step_fn() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    for ids in _batches(steps):
        rp.forward_backward((ids,), label=ids, loss_fn=_loss)
        rp.step(step_fn)
    rp.synchronize()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).clone()


@pytest.fixture(params=["cpu:1", "cpu:2"])
def devices(request: pytest.FixtureRequest) -> Iterator[int]:
    n = int(request.param.split(":")[1])
    yield from use_devices(request.param, n)


def test_layer_by_layer_is_bit_identical_to_the_whole_step(devices) -> None:
    check_bit_identical()


def check_bit_identical(pin_model: str = "off") -> None:
    """Train with the layer-by-layer publishing on and off; compare bit for bit (also run
    by tests/gpu/test_compact_publish_gpu.py)."""
    base = _tied_model()
    results = []
    for layer_by_layer in (True, False):
        rp = _rp(copy.deepcopy(base), layer_by_layer=layer_by_layer, pin_model=pin_model)
        opt = _adam(rp)
        _train(rp, opt)
        early = [p["early_layers"] for p in rp.step_phases]
        weights = [_bits(p) for p in rp.model.parameters()]
        state = [(k, _bits(v)) for s in opt.state_dict()["state"].values() for k, v in s.items()]
        results.append((weights, state, early))
        rp.close()
    (w_on, s_on, early_on), (w_off, s_off, early_off) = results
    assert early_on == [OWNERS] * STEPS  # every owner published while step_fn ran
    assert early_off == [0] * STEPS
    assert any(not torch.equal(a, _bits(b)) for a, b in zip(w_on, base.parameters(), strict=True))
    assert len(w_on) == len(w_off) and len(s_on) == len(s_off) > 0
    for a, b in zip(w_on, w_off, strict=True):
        assert torch.equal(a, b)
    for (ka, a), (kb, b) in zip(s_on, s_off, strict=True):
        assert ka == kb and torch.equal(a, b), ka


def test_adam_reports_in_forward_order_and_layer_0_is_published_first(cpu3, monkeypatch) -> None:
    """Each report sees the events as they were: layer 0 is published before the last
    parameters are updated, a layer only once all its weights are (the tied embedding
    once, for its owner), and the gradients stay the optimizer's through the step."""
    rp = _rp(_tied_model())
    opt = _adam(rp)
    _train(rp, opt, steps=1)
    layer_of = {id(pa.optim): pa.owner_layer for _, pa in rp._all_params()}
    seen: list[tuple[int, list[bool], list[bool]]] = []
    original = _LayerProgress.updated

    def recording(self: _LayerProgress, param: torch.Tensor) -> None:
        seen.append(
            (
                layer_of[id(param)],
                [a.param_copied.is_set() for a in rp.layer_attrs],
                [a.grad_copied.is_set() for a in rp.layer_attrs],
            )
        )
        original(self, param)

    monkeypatch.setattr(_LayerProgress, "updated", recording)
    _train(rp, opt, steps=1)
    layers = [j for j, _, _ in seen]
    assert layers == sorted(layers) and layers[0] == 0 and layers[-1] == OWNERS - 1
    assert len(layers) == len(list(rp.optim_parameters()))  # the tied weight counts once
    head = [True] * (LAYERS - OWNERS)  # owns nothing: published before step_fn
    assert seen[0][1] == [False] * OWNERS + head
    assert seen[-1][1] == [True] * (OWNERS - 1) + [False] + head
    assert not any(grad for _, _, g in seen for grad in g[:OWNERS])  # read in place
    for j, published, _ in seen:  # a layer is published after its last weight, not before
        assert not any(published[j:OWNERS])


@pytest.mark.parametrize(
    ("optimizer", "layer_by_layer", "expect_early"),
    [("engine", True, True), ("engine", False, False), ("torch", True, False)],
)
def test_next_call_uploads_while_step_fn_runs(
    cpu3, monkeypatch, optimizer: str, layer_by_layer: bool, expect_early: bool
) -> None:
    """step_fn waits after the optimizer's step until the next call has uploaded layer 0:
    it does once the layer is published early; with the switch off or an optimizer that
    reports nothing (torch's) the upload waits for step_fn and the wait times out."""
    rp = _rp(_tied_model(), layer_by_layer=layer_by_layer)
    params = list(rp.optim_parameters())
    opt: torch.optim.Optimizer = (
        eo.Adam(params, lr=1e-2, state_dtype=torch.uint8)
        if optimizer == "engine"
        else torch.optim.Adam(params, lr=1e-2)
    )
    _train(rp, opt, steps=1)
    layer0_up = threading.Event()
    original = RoundPipe.upload_group

    def watching(self: RoundPipe, dev: Any, layer_ids: range, run: Any, *a: Any, **kw: Any) -> Any:
        group = original(self, dev, layer_ids, run, *a, **kw)
        if 0 in layer_ids:
            layer0_up.set()
        return group

    monkeypatch.setattr(RoundPipe, "upload_group", watching)
    waited: list[bool] = []

    def step_fn() -> None:
        opt.step()
        waited.append(layer0_up.wait(timeout=30.0 if expect_early else 1.0))
        opt.zero_grad(set_to_none=True)

    ids = _batches(1)[0]
    rp.forward_backward((ids,), label=ids, loss_fn=_loss)
    layer0_up.clear()
    rp.step(step_fn)
    rp.forward_backward((ids,), label=ids, loss_fn=_loss)  # the next call
    rp.synchronize()
    assert waited == [expect_early]
    assert layer0_up.is_set()


def test_error_after_reports_sets_every_event_and_surfaces(cpu3) -> None:
    rp = _rp(_tied_model())
    opt = _adam(rp)
    _train(rp, opt, steps=1)

    def failing() -> None:
        opt.step()
        raise ValueError("after the update")

    rp.step(failing)
    with pytest.raises(StepError, match="after the update"):
        rp.synchronize()
    assert all(a.param_copied.is_set() and a.grad_copied.is_set() for a in rp.layer_attrs)
    _train(rp, opt, steps=1)  # goes on


def test_writing_a_weight_after_its_report_warns(cpu3) -> None:
    rp = _rp(_tied_model())
    opt = _adam(rp)
    _train(rp, opt, steps=1)
    ids = _batches(1)[0]

    def fix_up_after() -> None:
        opt.step()
        with torch.no_grad():
            next(iter(rp.parameters())).clamp_(-1.0, 1.0)
        opt.zero_grad(set_to_none=True)

    rp.forward_backward((ids,), label=ids, loss_fn=_loss)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rp.step(fix_up_after)
        rp.synchronize()
    assert any("after its optimizer reported" in str(w.message) for w in caught)


def test_default_mode_installs_no_progress(cpu3) -> None:
    """Without weights written in place every layer is published before step_fn: Adam
    runs its one kernel call, as before."""
    model = _tied_model().float()
    cfg = RoundPipeRunConfig(execute_plan=PLAN, num_microbatch=3)
    rp = RoundPipe(model, pin_model="off", model_run_config=cfg)
    opt = eo.Adam(list(rp.optim_parameters()), lr=1e-2)
    got: list[object] = []
    step: Callable[[], None] = opt.step

    def step_fn() -> None:
        got.append(step_progress())
        step()
        opt.zero_grad(set_to_none=True)

    ids = _batches(1)[0]
    rp.forward_backward((ids,), label=ids, loss_fn=_loss)
    rp.step(step_fn)
    rp.synchronize()
    assert got == [None]
