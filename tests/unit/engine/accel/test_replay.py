"""Replayed layer work (engine.accel.graphs) on virtual CPU devices, against the same runs without.

On CPU the graph is an eager stand-in that runs the captured function again at every
replay, so these tests check what the engine does around graphs: slots and their
gradient buffers, static inputs and cloned outputs, what layers save for their
recompute, the backward stitched from a replayed top and recomputed layers below it,
fallbacks, and that the captures stop growing. Bit-for-bit equality is expected: the
same operations run in the same order. The real CUDA graphs: tests/gpu/test_replay_gpu.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from engine import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from engine.accel import graphs
from engine.context import (
    doing_recompute,
    recompute_data_or_none,
    save_for_recompute,
    saving_for_recompute,
)

DIM, IN_DIM, OUT_DIM = 16, 8, 4


class InLayer(nn.Module):
    """Input projection that starts a (state, tag) carry; the tag is an integer tensor
    the replayed layers pass along untouched (as the presets pass labels)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(IN_DIM, DIM)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tag = torch.arange(x.shape[0]).unsqueeze(1).expand(x.shape[0], x.shape[1]).contiguous()
        return self.proj(x), tag


class Block(nn.Module):
    """A pre-norm residual MLP that opts in to replay.

    Like the presets' saved attention, its forward keeps a tensor for its recompute (a
    per-token scale, detached) that the recompute reads back instead of computing.
    """

    def __init__(self, *, replay: bool = True) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)
        self.replay = replay

    def rp_replay_key(self, carry: Any) -> Any:
        state = carry[0]
        if not self.replay:
            return None
        if saving_for_recompute():
            mode = "save"
        elif doing_recompute() and recompute_data_or_none() is not None:
            mode = "replay"
        else:
            mode = None
        return (DIM, tuple(state.shape), state.dtype, torch.is_grad_enabled(), mode)

    def forward(self, carry: Any) -> Any:
        x, tag = carry
        saved = recompute_data_or_none() if doing_recompute() else None
        if saved is not None:
            (scale,) = saved
        else:
            scale = x.detach().abs().mean(-1, keepdim=True) + 1.0
            save_for_recompute(scale)
        return x + self.down(F.gelu(self.up(self.norm(x)))) / scale, tag


class OutLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(DIM, OUT_DIM)

    def forward(self, carry: Any) -> torch.Tensor:
        x, tag = carry
        return self.head(x) + 0.0 * tag.unsqueeze(-1)


def make_model(blocks: int = 5, **block_kwargs: Any) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(InLayer(), *(Block(**block_kwargs) for _ in range(blocks)), OutLayer())


def batch(rows: int = 10, seq: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, seq, IN_DIM, generator=g), torch.randn(rows, seq, OUT_DIM, generator=g)


def mse(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((out - label) ** 2).mean()


def train(
    model: nn.Module,
    *,
    replay: bool,
    steps: int = 1,
    num_microbatch: int = 3,
    grain: str = "stage",
    plan: ModelExecutePlan | None = None,
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Losses, gradients of the last step and trained weights of `steps` AdamW steps."""
    graphs.ENABLED = replay
    x, y = batch()
    cfg = RoundPipeRunConfig(
        num_microbatch=num_microbatch, recompute_grain=grain, execute_plan=plan
    )
    rp = RoundPipe(model, optim_dtype=torch.float32, model_run_config=cfg)
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-2)

    def step_fn() -> None:
        opt.step()
        opt.zero_grad()

    losses = []
    grads: dict[str, torch.Tensor] = {}
    for k in range(steps):
        losses.append(rp.forward_backward((x,), label=y, loss_fn=mse))
        if k == steps - 1:
            rp.synchronize()
            grads = {n: p.grad.clone() for n, p in rp.model.named_parameters()}
        rp.step(step_fn)
    rp.synchronize()
    weights = {n: p.detach().clone() for n, p in rp.model.named_parameters()}
    return losses, grads, weights


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


GROUPED = ModelExecutePlan.from_ranges(
    [range(0, 3), range(3, 5), range(5, 7)],  # the input layer shares a group with blocks
    [range(2, 5), range(0, 2)],  # a backward group with the input layer below blocks
)


@pytest.mark.parametrize("num_microbatch", [1, 3, 4])
@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("plan", ["auto", "grouped"])
def test_replay_gives_the_same_training(
    replay_on_cpu: None, num_devices: int, num_microbatch: int, grain: str, plan: str
) -> None:
    execute_plan = GROUPED if plan == "grouped" else None
    before = graphs.stats()
    got = train(
        make_model(),
        replay=True,
        steps=3,
        num_microbatch=num_microbatch,
        grain=grain,
        plan=execute_plan,
    )
    after = graphs.stats()
    expected = train(
        make_model(),
        replay=False,
        steps=3,
        num_microbatch=num_microbatch,
        grain=grain,
        plan=execute_plan,
    )
    assert after["replays"] > before["replays"]
    assert after["failed"] == before["failed"]
    for a, b in zip(got[0], expected[0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert_same(got[1], expected[1])
    assert_same(got[2], expected[2])


def test_each_run_of_blocks_replays_and_captures_stop(replay_on_cpu: None, cpu3: int) -> None:
    """Forward and backward runs of blocks go through one graph each; once the device
    rotation has come round (5 jobs a call on 3 devices: every 3 calls, and slot sets
    alternate per device), calls capture nothing new: slots and graphs are reused."""
    model = make_model()
    x, y = batch()
    rp = RoundPipe(
        model, model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=GROUPED)
    )
    for _ in range(6):
        rp.forward_backward((x,), label=y, loss_fn=mse)
    captured = graphs.stats()["captures"]
    replays = graphs.stats()["replays"]
    for _ in range(6):
        rp.forward_backward((x,), label=y, loss_fn=mse)
    assert graphs.stats()["captures"] == captured
    # One replay per run of blocks and micro-batch, not per block: forward group 0 has two
    # runs (block 2's input is kept for the backward group that starts there), forward
    # group 1 one, each backward group one (block 1 above the recomputed input layer).
    assert graphs.stats()["replays"] - replays == 6 * 2 * (2 + 1 + 1 + 1)


def test_layers_that_decline_run_as_they_are(replay_on_cpu: None, num_devices: int) -> None:
    def mixed() -> nn.Sequential:
        model = make_model()
        model[3].replay = False  # a block in the middle of a group declines
        return model

    got = train(mixed(), replay=True, steps=2, plan=GROUPED)
    expected = train(mixed(), replay=False, steps=2, plan=GROUPED)
    assert_same(got[1], expected[1])
    assert_same(got[2], expected[2])


def test_a_failed_capture_falls_back(
    replay_on_cpu: None, cpu3: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A run whose capture raises (an op that cannot be captured) runs as it is, with a
    warning, and is not captured again."""

    class Flaky(Block):
        def forward(self, carry: Any) -> Any:
            if graphs_capturing[0]:
                raise RuntimeError("operation not permitted when stream is capturing")
            return super().forward(carry)

    graphs_capturing = [False]
    real_capture = graphs._EagerGraph.capture

    def capture(self: Any, body: Any, modules: Any) -> None:
        graphs_capturing[0] = True
        try:
            body(True, modules)  # the CUDA backend runs the body while capturing
        finally:
            graphs_capturing[0] = False
        real_capture(self, body, modules)

    torch.manual_seed(0)
    model = nn.Sequential(InLayer(), Flaky(), Flaky(), OutLayer())
    reference = copy.deepcopy(model)
    before = graphs.stats()
    graphs._EagerGraph.capture = capture  # type: ignore[method-assign]
    try:
        got = train(model, replay=True, steps=2)
    finally:
        graphs._EagerGraph.capture = real_capture  # type: ignore[method-assign]
    expected = train(reference, replay=False, steps=2)
    assert graphs.stats()["failed"] > before["failed"]
    assert "capture failed" in caplog.text
    assert_same(got[2], expected[2])


def test_forward_and_autograd_backward_replay(replay_on_cpu: None, num_devices: int) -> None:
    """rp(x) with grad (forward jobs, then backward jobs through autograd) and rp(x)
    without grad: the same outputs and gradients as without replay."""
    results = []
    for replay in (True, False):
        graphs.ENABLED = replay
        model = make_model()
        x, _ = batch()
        xr = x.clone().requires_grad_(True)
        rp = RoundPipe(model, model_run_config=RoundPipeRunConfig(num_microbatch=3))
        with torch.no_grad():
            plain = rp(x)
        out = rp(xr)
        (out**2).mean().backward()
        rp.synchronize()
        grads = {n: p.grad.clone() for n, p in rp.model.named_parameters()}
        results.append((plain, out.detach(), xr.grad, grads))
    for a, b in zip(results[0][:3], results[1][:3], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert_same(results[0][3], results[1][3])


def test_big_micro_batches_stop_replay(replay_on_cpu: None, cpu3: int) -> None:
    """Over REPLAY_MAX_TOKENS the model stops using slots (long sequences gain nothing),
    and trains as without replay."""
    graphs.REPLAY_MAX_TOKENS = 4  # 10 rows x 6 tokens in 3 micro-batches is over it
    before = graphs.stats()
    model = make_model()
    got = train(model, replay=True, steps=2)
    assert graphs.stats()["replays"] == before["replays"]
    expected = train(make_model(), replay=False, steps=2)
    assert_same(got[2], expected[2])


def test_slots_alternate_between_jobs(replay_on_cpu: None, cpu3: int) -> None:
    """Consecutive jobs on a device get different slots (the next upload must not wait
    for this job's compute); the job after next gets this job's slots back."""
    from engine.device import get_devices
    from engine.transfer import make_replica

    rep = graphs.replayer(get_devices()[0])
    assert rep is not None
    replicas = [make_replica(Block()) for _ in range(3)]
    first = rep.acquire(replicas, [True, True, False])
    second = rep.acquire(replicas[:2], [True, True])
    third = rep.acquire(replicas[:1], [True])
    assert first[2] is None
    assert {id(s) for s in first[:2]}.isdisjoint({id(s) for s in second})
    assert third[0] is first[0]


def test_a_recompute_reads_each_layers_saved_data_just_before_it(
    cpu3: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without replay, a layer's saved data is uploaded right before its recompute, not the
    whole group's up front: an upload makes the compute stream wait, and up front the
    group's later layers' uploads could not run under the earlier layers' recompute."""
    import engine.run

    events: list[tuple[str, int]] = []
    real = engine.run._recompute_data

    def recompute_data(run: Any, dev: Any, layer_id: int, mb: int) -> Any:
        events.append(("data", layer_id))
        return real(run, dev, layer_id, mb)

    monkeypatch.setattr(engine.run, "_recompute_data", recompute_data)
    model = make_model()
    for index, block in enumerate(model):
        if isinstance(block, Block):
            block.register_forward_pre_hook(
                lambda _m, _a, index=index: (
                    events.append(("recompute", index)) if doing_recompute() else None
                )
            )
    train(model, replay=False, plan=GROUPED)
    recomputes = [k for k, e in enumerate(events) if e[0] == "recompute"]
    assert len(recomputes) == 4 * 3  # blocks 1-4 (block 5 is in the fused tail), 3 micro-batches
    for k in recomputes:
        assert events[k - 1] == ("data", events[k][1])


def test_a_paused_model_replays_nothing_and_resumes_after(replay_on_cpu: None, cpu3: int) -> None:
    """`replay_paused()` runs this model's calls as they are (same results); the next call
    after the block replays again."""
    model = make_model()
    x, _ = batch()
    rp = RoundPipe(
        model, model_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=GROUPED)
    )
    with torch.no_grad():
        want = rp(x)
        before = graphs.stats()
        with rp.replay_paused():
            got = rp(x)
        assert graphs.stats() == before
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        rp(x)
    assert graphs.stats()["replays"] > before["replays"]
