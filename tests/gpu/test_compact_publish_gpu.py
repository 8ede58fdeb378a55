"""optim_memory='compact' publishing layer by layer on CUDA: pinned weights that the next
call's uploads copy while the optimizer updates later layers, the same training as the
whole-step path, bit for bit."""

from __future__ import annotations

import pytest

from tests.unit.engine import test_compact_publish as cpu_tests

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("pin_model", ["alloc", "arena"])
def test_layer_by_layer_is_bit_identical_on_cuda(cuda_devices: int, pin_model: str) -> None:
    cpu_tests.check_bit_identical(pin_model)
