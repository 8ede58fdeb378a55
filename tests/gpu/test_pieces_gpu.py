"""HostPieces on CUDA: big activations pinned in power-of-two pieces, bit-exact round trip,
and training with every internal download in pieces equal to training without."""

from __future__ import annotations

import copy

import pytest
import torch

import engine.transfer as transfer
from engine import RoundPipe, RoundPipeRunConfig
from engine.device import get_next_device
from engine.transfer import HostPieces, async_d2h, async_h2d
from tests.unit.engine._models import make_batch
from tests.unit.engine.test_transfer_pieces import FUSED_PLAN, TRAIN_PLAN, _model, _mse

pytestmark = pytest.mark.gpu

MIB = 1 << 20


def test_300_mib_download_is_pinned_in_pieces_and_comes_back_bit_exact(
    cuda_devices: int,
) -> None:
    dev = get_next_device()
    n = 300 * MIB // 2 - 12345  # fp16 elements: just under 300 MiB, not a granule multiple
    gen = torch.Generator(device=dev.device).manual_seed(0)
    src = torch.randn(n, generator=gen, device=dev.device).half().view(3, -1)
    small = torch.randn(1000, device=dev.device)
    # Made on the default stream, which the engine's streams do not wait for.
    torch.cuda.synchronize(dev.device)
    host, ev = async_d2h(dev, [src, small, 7], pieces=True)
    hp = host[0]
    assert isinstance(hp, HostPieces)
    assert isinstance(host[1], torch.Tensor) and host[1].is_pinned()  # under the threshold
    assert host[2] == 7
    pinned = sum(p.numel() for p in hp.pieces)
    assert src.numel() * 2 <= pinned < 302 * MIB  # one pinned tensor would take 512 MiB
    assert sorted(p.numel() for p in hp.pieces) == [4 * MIB, 8 * MIB, 32 * MIB, 256 * MIB]
    assert all(p.is_pinned() for p in hp.pieces)
    back = async_h2d(dev, [ev], [hp, host[1]])
    torch.cuda.synchronize(dev.device)
    assert back[0].is_cuda and back[0].shape == src.shape and back[0].dtype == src.dtype
    assert torch.equal(back[0].view(torch.int16), src.view(torch.int16))
    assert torch.equal(back[1], small)
    plain, _ = async_d2h(dev, [src])  # pieces off (the default): one pinned tensor
    assert isinstance(plain[0], torch.Tensor) and plain[0].is_pinned()


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_training_with_pieces_matches_training_without(
    cuda_devices: int, monkeypatch: pytest.MonkeyPatch, grain: str
) -> None:
    """Every internal download in pieces of 256 bytes (threshold lowered): same loss,
    outputs, input gradients and parameter gradients as with one pinned tensor each."""
    x, y = make_batch(batch=6)
    fused_cfg = RoundPipeRunConfig(execute_plan=FUSED_PLAN)
    train_cfg = RoundPipeRunConfig(execute_plan=TRAIN_PLAN)
    made: list[HostPieces] = []
    real_empty = HostPieces.empty.__func__  # type: ignore[attr-defined]

    def counting_empty(cls, *args, **kwargs):  # type: ignore[no-untyped-def]
        hp = real_empty(cls, *args, **kwargs)
        made.append(hp)
        return hp

    def run(rp: RoundPipe) -> tuple[torch.Tensor, ...]:
        loss = rp.forward_backward((x,), label=y, loss_fn=_mse, run_config=fused_cfg)
        xr = x.clone().requires_grad_(True)
        out = rp(xr, roundpipe_run_config=train_cfg)
        assert isinstance(out, torch.Tensor)
        out.pow(2).sum().backward()
        rp.synchronize()
        return (loss, out.detach(), xr.grad, *[p.grad.clone() for p in rp.model.parameters()])

    model = _model()
    cfg = RoundPipeRunConfig(num_microbatch=3, recompute_grain=grain)
    want = run(RoundPipe(copy.deepcopy(model), model_run_config=cfg))
    assert not made
    monkeypatch.setattr(transfer, "PIECES_MIN_BYTES", 1)
    monkeypatch.setattr(transfer, "PIECE_GRANULE_BYTES", 256)
    monkeypatch.setattr(HostPieces, "empty", classmethod(counting_empty))
    got = run(RoundPipe(copy.deepcopy(model), model_run_config=cfg))
    assert len(made) > 0 and any(len(hp.pieces) > 1 for hp in made)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
