"""One GPU: the automatic plan's fused tail takes the top backward group's layers once their
activations are measured (engine.planning.one_device), and training matches the plan without.

Oracle: the same model trained with widening off (fp32, TF32 off), at rtol 1e-5.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from engine import ModelExecutePlan
from engine.planning import one_device
from tests import tiny_models
from tests.unit.engine.conftest import use_devices
from tests.unit.engine.planning.test_one_device import VOCAB, train_lm

pytestmark = pytest.mark.gpu

SEQ, CALLS = 64, 6


@pytest.fixture
def one_gpu(cuda_devices: int) -> Iterator[int]:
    yield from use_devices("cuda:0", 1)


def last_plan(rp: torch.nn.Module) -> ModelExecutePlan:
    plans = rp._plans  # (run type, devices, maturity, ...) -> plan
    return plans[max(plans, key=lambda k: k[2])]


def train(model: torch.nn.Module) -> tuple[list[float], dict[str, torch.Tensor], torch.nn.Module]:
    return train_lm(model, calls=CALLS, seq=SEQ)


def tiny_model() -> torch.nn.Module:
    return tiny_models.tiny_model(
        "qwen3", vocab_size=VOCAB, num_hidden_layers=6, tie_word_embeddings=False
    )


def spy_on_widening(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(the automatic plan's tail start, the widened one) of every plan made from now on."""
    seen: list[tuple[int, int]] = []
    real = one_device.widen_tail

    def spy(plan: ModelExecutePlan, *args: Any) -> ModelExecutePlan:
        out = real(plan, *args)
        seen.append((plan.fwd_plan[-1].start, out.fwd_plan[-1].start))
        return out

    monkeypatch.setattr(one_device, "widen_tail", spy)
    return seen


def test_the_tail_widens_on_one_gpu_and_trains_as_without(
    one_gpu: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model()
    seen = spy_on_widening(monkeypatch)
    losses, weights, rp = train(copy.deepcopy(model))
    assert any(wide < auto for auto, wide in seen), seen
    assert last_plan(rp).fwd_plan[-1].start == seen[-1][1]
    meter = rp.activation_meter
    n = rp.num_layers
    decoder = [a for a in meter.layer[1 : n - 1] if a is not None]
    assert decoder and all(a > 0 for a in decoder)
    assert meter.tail.get(n - 1, 0) > 0 and meter.held > 0
    monkeypatch.setattr(one_device, "WIDEN_TAIL", False)
    ref_losses, ref_weights, ref_rp = train(copy.deepcopy(model))
    # decoder layers joined the head
    assert last_plan(rp).fwd_plan[-1].start < last_plan(ref_rp).fwd_plan[-1].start
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for k, w in ref_weights.items():
        torch.testing.assert_close(weights[k], w, rtol=1e-5, atol=1e-6)


def test_no_room_no_widening(one_gpu: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(one_device, "MEMORY_FRACTION", 0.0)
    seen = spy_on_widening(monkeypatch)
    _, _, rp = train(tiny_model())
    assert rp.activation_meter.tail  # measured, but the device has no room by this rule
    assert seen and all(wide == auto for auto, wide in seen), seen
