"""Session 16's engine changes on CUDA (written without a GPU; first run next session):
buffers written in the forward come back through the download stream, the device copies
follow train()/eval(), packed outputs carry gradients, reducers fold."""

from __future__ import annotations

import pytest

from tests.unit.engine import test_buffers, test_packed_outputs

pytestmark = pytest.mark.gpu


def test_standalone_buffer_writes_come_back_cuda(cuda_devices: int) -> None:
    test_buffers.test_a_python_write_to_a_standalone_buffer_comes_back(cuda_devices)


def test_batchnorm_running_statistics_come_back_cuda(cuda_devices: int) -> None:
    test_buffers.test_batchnorm_running_statistics_come_back(cuda_devices)


def test_the_device_copies_follow_train_and_eval_cuda(cuda_devices: int) -> None:
    test_buffers.test_the_device_copies_follow_train_and_eval(cuda_devices)


def test_a_packed_output_chains_and_back_cuda(cuda_devices: int) -> None:
    test_packed_outputs.test_a_packed_output_chains_into_another_model_and_back(cuda_devices)


@pytest.mark.parametrize("reducer", ["avg", "sum"])
def test_a_reducer_folds_forward_and_backward_cuda(reducer: str, cuda_devices: int) -> None:
    test_packed_outputs.test_a_reducer_folds_the_micro_batches_forward_and_backward(
        reducer, cuda_devices
    )
