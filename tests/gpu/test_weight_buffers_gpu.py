"""Double-buffered weights (RoundPipe double_buffer_weights) on CUDA: both copies pinned,
uploads racing the swap for real, the same training as converting the masters, bit for bit
(SDPA's math kernels: no atomics)."""

from __future__ import annotations

import pytest
import torch

import engine.optim as eo
from engine import RoundPipe
from tests.gpu.test_overlap_gpu import math_sdpa  # noqa: F401  (fixture)
from tests.unit.engine._models import make_model
from tests.unit.engine.accel import test_weight_buffers as cpu_tests

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("overlap", [False, True])
def test_swapped_weights_train_bit_for_bit_on_cuda(
    cuda_devices: int,
    math_sdpa: None,  # noqa: F811
    overlap: bool,
) -> None:
    cpu_tests.test_swapped_weights_train_bit_for_bit_as_converted_ones(cuda_devices, overlap)


def test_held_up_backward_and_the_swap_on_cuda(
    cuda_devices: int,
    math_sdpa: None,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu_tests.test_the_swap_waits_for_the_running_calls_uploads(cuda_devices, monkeypatch)


@pytest.mark.parametrize("pin_model", ["alloc", "register", "arena"])
def test_both_copies_are_pinned(cuda_devices: int, pin_model: str) -> None:
    model = make_model(p_drop=0.0).to(cpu_tests.DTYPE)
    rp = RoundPipe(
        model, optim_dtype=torch.float32, pin_model=pin_model, double_buffer_weights=True
    )
    opt = eo.Adam(rp.optim_parameters(), lr=1e-2)
    x, y = cpu_tests.half_batches(1)[0]
    for _ in range(2):
        rp.forward_backward((x,), label=y, loss_fn=cpu_tests.mse)
        rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    for p in model.parameters():
        master = eo.get_model_copy(rp_master(p))
        assert p.is_pinned() and master is not None and master.is_pinned()


def rp_master(p: torch.nn.Parameter) -> torch.Tensor:
    from engine.attribute import ParamAttribute

    master = ParamAttribute.get(p).optim
    assert master is not None
    return master


def test_a_freed_host_block_is_unregistered(cuda_devices: int) -> None:
    """A registration outliving its memory makes a later mapping at those addresses count
    as pinned (copies from it then fail): the block is unregistered with its last view."""
    import gc

    from engine.memory import host_block

    block = host_block(1 << 22, pinned=True)
    view = block[4096:8192].view(torch.float16)
    assert view.is_pinned()
    address = block.data_ptr()
    del block
    gc.collect()
    cudart = torch.cuda.cudart()
    assert view.is_pinned()  # a view keeps the block, and its registration, alive
    del view
    gc.collect()
    # 713: cudaErrorHostMemoryNotRegistered (0 would mean it was still registered)
    assert int(cudart.cudaHostUnregister(address)) == 713
