"""Issue 15 on CUDA: the in-place half gradient and the cudaHostRegister'ed arena train
bit-identically to the fp32 gradient buffer and torch-pinned parameters."""

from __future__ import annotations

import copy

import pytest
import torch

import engine.optim as eo
from engine import RoundPipe
from engine.attribute import ParamAttribute
from tests.unit.engine._models import make_batch, make_model

pytestmark = pytest.mark.gpu


def _mse(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((out.float() - label.to(out.device).float()) ** 2).mean()


def _train(rp: RoundPipe) -> None:
    opt = eo.Adam(list(rp.optim_parameters()), lr=1e-2, weight_decay=0.01)
    x, y = make_batch(batch=12)

    def step_fn() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(4):
        for c in range(2):
            rp.forward_backward((x[c::2].half(),), label=y[c::2], loss_fn=_mse)
        rp.step(step_fn)  # asynchronous: the next downloads wait for the whole step
    rp.synchronize()


def test_in_place_grads_and_arena_match_the_default_cuda(cuda_devices: int) -> None:
    base = make_model(p_drop=0.0).half()
    ref = RoundPipe(copy.deepcopy(base), optim_dtype=torch.float32, pin_model="alloc")
    got = RoundPipe(
        copy.deepcopy(base),
        optim_dtype=torch.float32,
        optim_grad_dtype=torch.float16,
        pin_model="arena",
    )
    for p in got.model.parameters():
        assert p.is_pinned() and ParamAttribute.get(p).grad_host.is_pinned()
    _train(ref)
    _train(got)
    for a, b in zip(ref.optim_parameters(), got.optim_parameters(), strict=True):
        assert torch.equal(a, b)
    # The model copies (what the next forward uploads), read after synchronize().
    for (_, a), (_, b) in zip(
        ref.model.named_parameters(), got.model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b)


_ARENA_PEAK_SCRIPT = """
import gc, json
import torch
from torch import nn
from engine.memory import pin_module_arena

def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))

torch.cuda.init()
model = nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(16)])  # 1 GiB fp32
for p in model.parameters():
    p.requires_grad_(False)
gc.collect()
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the high-water mark from here on
pin_module_arena(model)
gc.collect()
print(json.dumps({
    "model": sum(p.numel() * 4 for p in model.parameters()),
    "largest": 4096 * 4096 * 4,
    "peak": status("VmHWM") - before,
    "end": status("VmRSS") - before,
    "pinned": all(p.is_pinned() for p in model.parameters()),
}))
"""


def test_arena_pinning_peaks_at_one_tensor_over_the_model(cuda_devices: int) -> None:
    """The arena is filled before it is registered (registering faults in every page), so
    moving a model into it holds the model plus about one tensor, not two models."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", _ARENA_PEAK_SCRIPT],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    f = json.loads(out.stdout.strip().splitlines()[-1])
    assert f["pinned"]
    # Peak over the starting RSS: the arena's pages fill as the old tensors go; before the
    # fix it was the whole model (the registered arena) on top of the model.
    assert f["peak"] < f["largest"] * 3, f
    assert f["end"] < f["largest"] * 2, f
