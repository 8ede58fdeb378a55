"""The fold during the backward (engine.fold_ahead) on CUDA: pinned download buffers whose
gradients land on the download stream's events, summed there and handed to the C Adam
uncopied (engine.optim._deferred), the same training as the copy and the fold in the step,
bit for bit (losses, clip norms, weights, gradients), every gradient taken by its step."""

from __future__ import annotations

import pytest

from tests.unit.engine import test_fold_ahead as cpu_tests

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    ("mode", "calls_per_step"),
    [("fp32-masters", 1), ("fp32-masters", 3), ("12-byte", 1), ("compact", 1)],
)
def test_fold_ahead_is_bit_identical_on_cuda(
    cuda_devices: int, math_attention: None, mode: str, calls_per_step: int
) -> None:
    cpu_tests.check_equal_to_the_fold_in_the_step(
        mode, calls_per_step=calls_per_step, step_staleness=0
    )


def test_copied_gradients_on_cuda(cuda_devices: int, math_attention: None) -> None:
    """The path a step_fn that reads `.grad` leaves: every gradient copied while the backward
    runs, the copy taken by the step."""
    cpu_tests.check_equal_to_the_fold_in_the_step("fp32-masters", defer=False, step_staleness=0)


def test_tied_weight_on_cuda(cuda_devices: int, math_attention: None) -> None:
    cpu_tests.check_tied_weight()
