"""Overlapped calls (RoundPipe overlap_calls) on CUDA, where uploads, downloads and the
step's publish race for real: the same training as the calls one after the other, bit for
bit (fp32, TF32 off, SDPA's math kernels: no atomics), including a call whose last
backward job is held up while the next step is launched."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.unit.engine import test_overlap as cpu_tests
from tests.unit.engine._models import make_model

pytestmark = pytest.mark.gpu


@pytest.fixture
def math_sdpa() -> Iterator[None]:
    backends = torch.backends.cuda
    saved = backends.flash_sdp_enabled(), backends.mem_efficient_sdp_enabled()
    backends.enable_flash_sdp(False)
    backends.enable_mem_efficient_sdp(False)
    try:
        yield
    finally:
        backends.enable_flash_sdp(saved[0])
        backends.enable_mem_efficient_sdp(saved[1])


@pytest.mark.parametrize(
    "plan", [cpu_tests.GROUPED, cpu_tests.SPLIT_TAIL], ids=["grouped", "split"]
)
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_overlapped_training_is_bit_for_bit_the_same_on_cuda(
    cuda_devices: int, math_sdpa: None, plan: object, grain: str
) -> None:
    got = cpu_tests.run_steps(make_model(p_drop=0.0), overlap=True, grain=grain, plan=plan)
    expected = cpu_tests.run_steps(make_model(p_drop=0.0), overlap=False, grain=grain, plan=plan)
    cpu_tests.assert_runs_equal(got, expected)


def test_held_up_backward_on_cuda(
    cuda_devices: int, math_sdpa: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu_tests.test_a_call_returns_before_its_backward_and_the_step_waits_for_it(
        cuda_devices, monkeypatch
    )


def test_gradient_accumulation_on_cuda(cuda_devices: int, math_sdpa: None) -> None:
    cpu_tests.test_gradients_accumulate_over_overlapped_calls(cuda_devices)
