"""Each GPU's busy time on CUDA (engine.device.BusyReader): the compute stream's time in the
layers, attributed to the GPU that ran them; never more than the calls' wall time."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from engine import RoundPipe, RoundPipeRunConfig
from engine.device import BusyReader, get_devices

pytestmark = pytest.mark.gpu


def test_every_gpu_computes_and_none_is_busier_than_the_wall_time(cuda_devices: int) -> None:
    torch.manual_seed(0)
    width, rows = 2048, 8192
    model = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(8)))
    rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=4))
    x, y = torch.randn(rows, width), torch.randn(rows, width)

    def loss_fn(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return ((out.float() - label) ** 2).mean()

    for _ in range(2):  # warm-up, and the plan from measured times
        rp.forward_backward((x,), label=y, loss_fn=loss_fn)
    torch.cuda.synchronize()
    reader = BusyReader()
    started = time.perf_counter()
    for _ in range(3):
        rp.forward_backward((x,), label=y, loss_fn=loss_fn)
    torch.cuda.synchronize()
    wall_s = time.perf_counter() - started
    window = reader.read()
    assert [b.device for b in window] == [d.name for d in get_devices()]
    for b in window:
        assert b.jobs > 0 and 0 < b.busy_s <= wall_s, (b, wall_s)
