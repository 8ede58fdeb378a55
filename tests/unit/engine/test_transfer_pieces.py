"""HostPieces: big activations pinned in power-of-two pieces instead of one rounded tensor.

The sizing is pure arithmetic; the piecewise copies run here with unpinned host buffers and
a CPU "device" tensor (the same code the CUDA path runs with pinned buffers and
non_blocking copies); the run.py call sites are checked by a CPU training run whose
internal downloads are turned into HostPieces.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import engine.run as engine_run
from engine import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from engine.context import doing_recompute, get_recompute_data, save_for_recompute
from engine.device import DeviceManager
from engine.planning.memory_plan import _PIECE_GRANULE_BYTES, _PIECES_MIN_BYTES, _activation_pinned
from engine.transfer import (
    PIECE_GRANULE_BYTES,
    PIECES_MIN_BYTES,
    HostPieces,
    async_d2h,
    async_h2d,
    piece_sizes,
)
from tests.unit.engine._models import make_batch, make_model

MIB = 1 << 20
GIB = 1 << 30


# ---- sizing ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "nbytes",
    [
        1,
        17,
        MIB,
        2 * MIB,
        2 * MIB + 1,
        96 * MIB,
        300 * MIB,
        1000003 * 7,
        5 * GIB // 4,
        40 * GIB - 1,
    ],
)
def test_piece_sizes_cover_the_bytes_with_few_powers_of_two(nbytes: int) -> None:
    sizes = piece_sizes(nbytes)
    total = sum(sizes)
    assert total >= nbytes
    assert total - nbytes < PIECE_GRANULE_BYTES
    assert total % PIECE_GRANULE_BYTES == 0
    for n in sizes:
        assert n >= PIECE_GRANULE_BYTES and n & (n - 1) == 0
    assert sizes == sorted(sizes, reverse=True)
    assert len(set(sizes)) == len(sizes)  # one piece per set bit
    assert len(sizes) <= max(1, (total // PIECE_GRANULE_BYTES).bit_length())


def test_piece_sizes_of_the_qwen3_hidden_state() -> None:
    """(327680, 2048) fp16 = 1.25 GiB: 1 GiB + 256 MiB, not one 2 GiB block."""
    assert piece_sizes(327680 * 2048 * 2) == [GIB, GIB // 4]


def test_piece_sizes_edge_cases() -> None:
    assert piece_sizes(0) == []
    assert piece_sizes(-5) == []
    assert piece_sizes(100, granule=1) == [64, 32, 4]
    assert piece_sizes(2**21 * 1023) == [2**21 * (1 << k) for k in range(9, -1, -1)]  # 10 bits
    for bad in (0, -2, 3, 3 * MIB):
        with pytest.raises(ValueError, match="power of two"):
            piece_sizes(10, granule=bad)


def test_memory_plan_mirrors_the_transfer_constants() -> None:
    """memory_plan stays torch-free, so it repeats the two constants: they must agree."""
    assert (_PIECES_MIN_BYTES, _PIECE_GRANULE_BYTES) == (PIECES_MIN_BYTES, PIECE_GRANULE_BYTES)
    hidden = 327680 * 2048 * 2
    assert _activation_pinned(hidden, cuda=True) == sum(piece_sizes(hidden)) == hidden
    assert _activation_pinned(48 * MIB, cuda=True) == 64 * MIB  # below: one rounded tensor
    assert _activation_pinned(hidden, cuda=False) == hidden  # CPU: nothing pinned


# ---- the piecewise round trip -------------------------------------------------------------
def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    return torch.randint(-1000, 1000, shape, generator=gen).to(dtype)


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8),
            b.contiguous().reshape(-1).view(torch.uint8),
        )
    )


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int64, torch.bool]
)
@pytest.mark.parametrize("shape", [(1,), (17, 3), (1000003,), (5, 7, 11), (0, 4)])
@pytest.mark.parametrize("granule", [8, 64, 4096])
def test_host_pieces_round_trip_is_bit_exact(
    dtype: torch.dtype, shape: tuple[int, ...], granule: int
) -> None:
    src = _random(shape, dtype)
    hp = HostPieces.of(src, pin=False, granule=granule)
    nbytes = src.numel() * src.element_size()
    assert hp.nbytes == nbytes
    assert sum(p.numel() for p in hp.pieces) == sum(piece_sizes(nbytes, granule))
    assert all(p.dtype == torch.uint8 and p.dim() == 1 for p in hp.pieces)
    back = hp.to_device(torch.device("cpu"), non_blocking=False)
    assert _bit_equal(back, src)
    assert back.is_contiguous() and not back.requires_grad


def test_host_pieces_keep_nan_payloads_and_negative_zero() -> None:
    """A byte copy, not a value copy: NaN bit patterns and -0.0 survive."""
    src = torch.tensor([0x7E01, 0xFE42 - 0x10000, -0x8000, 0x7C00, 0x0001], dtype=torch.int16).view(
        torch.float16
    )
    back = HostPieces.of(src, pin=False, granule=2).to_device(
        torch.device("cpu"), non_blocking=False
    )
    assert torch.equal(back.view(torch.int16), src.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_host_pieces_of_a_non_contiguous_tensor(dtype: torch.dtype) -> None:
    base = _random((37, 29, 3), dtype, seed=1)
    views = [base.transpose(0, 1), base[:, ::2], base[..., 1], base.permute(2, 0, 1)[1:]]
    for v in views:
        assert not v.is_contiguous()
        back = HostPieces.of(v, pin=False, granule=16).to_device(
            torch.device("cpu"), non_blocking=False
        )
        assert _bit_equal(back, v)


def test_host_pieces_refuse_another_shape_or_dtype() -> None:
    hp = HostPieces.empty(torch.Size([4, 4]), torch.float16, pin=False, granule=8)
    with pytest.raises(ValueError, match="cannot hold"):
        hp.copy_from(torch.zeros(4, 5, dtype=torch.float16), non_blocking=False)
    with pytest.raises(ValueError, match="cannot hold"):
        hp.copy_from(torch.zeros(4, 4, dtype=torch.bfloat16), non_blocking=False)


def test_async_h2d_uploads_host_pieces_among_other_leaves() -> None:
    dev = DeviceManager(0, torch.device("cpu"))
    try:
        a = _random((33, 7), torch.bfloat16)
        b = _random((5,), torch.float32, seed=2)
        hp = HostPieces.of(a, pin=False, granule=32)
        hp.requires_grad = True
        out = async_h2d(dev, [None], [hp, 3, b, None])
        assert _bit_equal(out[0], a) and not out[0].requires_grad
        assert out[1] == 3 and out[3] is None and torch.equal(out[2], b)
        kept = async_h2d(dev, [None], [hp], keep_requires_grad=True)
        assert _bit_equal(kept[0].detach(), a) and kept[0].requires_grad
    finally:
        dev.shutdown_controller()


def test_async_d2h_keeps_plain_tensors_on_cpu_devices() -> None:
    """CPU devices pin nothing: pieces=True changes nothing there."""
    dev = DeviceManager(0, torch.device("cpu"))
    try:
        t = torch.zeros(PIECES_MIN_BYTES // 2 + 1, dtype=torch.float16)
        out, ev = async_d2h(dev, [t, "x"], pieces=True)
        assert ev is None and isinstance(out[0], torch.Tensor) and out[1] == "x"
    finally:
        dev.shutdown_controller()


# ---- the engine's call sites -----------------------------------------------------------
class SavesForRecompute(nn.Module):
    """x + W(x * 2), where the forward saves x * 2 and the recompute reads it back."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if doing_recompute():
            (h,) = get_recompute_data()
            # The saved tensor equals what the forward would compute: any corruption on the
            # way through the pieces changes the gradients.
            h = h.to(x.dtype)
        else:
            h = (x * 2).detach()
            save_for_recompute(h)
        return x + self.lin(h)


def _model() -> nn.Sequential:
    base = make_model(p_drop=0.0)
    torch.manual_seed(1)
    return nn.Sequential(*base[:3], SavesForRecompute(16), *base[3:])


def _as_pieces(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Make engine.run's async_d2h return HostPieces for every tensor where pieces=True
    (a CPU device never does): records each call's `pieces`."""
    real = engine_run.async_d2h
    calls: list[bool] = []

    def fake(dev: Any, tensors: Any, keep_requires_grad: bool = False, *, pieces: bool = False):
        host, ev = real(dev, tensors, keep_requires_grad, pieces=pieces)
        calls.append(pieces)
        if pieces:
            host = [
                HostPieces.of(t, pin=False, granule=8) if isinstance(t, torch.Tensor) else t
                for t in host
            ]
        return host, ev

    monkeypatch.setattr(engine_run, "async_d2h", fake)
    return calls


def _grads(rp: RoundPipe) -> list[torch.Tensor]:
    return [p.grad.clone() for p in rp.model.parameters()]


# Three forward groups; backward groups that cut inside them.
FUSED_PLAN = ModelExecutePlan.from_ranges(
    [range(0, 3), range(3, 6), range(6, 8)], [range(3, 6), range(1, 3), range(0, 1)]
)
TRAIN_PLAN = ModelExecutePlan.from_ranges(
    [range(0, 3), range(3, 6), range(6, 8)], [range(5, 8), range(2, 5), range(0, 2)]
)


def _mse(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((out - label) ** 2).mean()


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("plan", ["auto", "explicit"])
def test_training_with_host_pieces_matches_plain_tensors(
    num_devices: int, monkeypatch: pytest.MonkeyPatch, grain: str, plan: str
) -> None:
    """forward_backward and forward + backward give bit-identical losses, outputs and
    gradients when every internal download is HostPieces; the caller gets tensors."""
    x, y = make_batch(batch=6)
    explicit = plan == "explicit"
    fused_cfg = RoundPipeRunConfig(execute_plan=FUSED_PLAN if explicit else None)
    train_cfg = RoundPipeRunConfig(execute_plan=TRAIN_PLAN if explicit else None)

    def run(rp: RoundPipe) -> tuple[Any, ...]:
        loss = rp.forward_backward((x,), label=y, loss_fn=_mse, run_config=fused_cfg)
        xr = x.clone().requires_grad_(True)
        out = rp(xr, roundpipe_run_config=train_cfg)
        assert isinstance(out, torch.Tensor)  # the caller's outputs stay tensors
        out.pow(2).sum().backward()
        rp.synchronize()
        return loss, out.detach(), xr.grad, _grads(rp)

    model = _model()
    cfg = RoundPipeRunConfig(num_microbatch=3, recompute_grain=grain)
    want = run(RoundPipe(copy.deepcopy(model), model_run_config=cfg))
    calls = _as_pieces(monkeypatch)
    got = run(RoundPipe(copy.deepcopy(model), model_run_config=cfg))
    assert any(calls) and not all(calls)  # internal data went as pieces, the user's did not
    assert isinstance(got[2], torch.Tensor)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[2], want[2])
    for a, b in zip(got[3], want[3], strict=True):
        assert torch.equal(a, b)
