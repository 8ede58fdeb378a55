"""Replayed CUDA graphs of the presets' decoder layers (engine.accel.graphs) on the GPU.

A tiny fp16 Qwen3 through the compiled decoder layers, with replay on and off. The
attention backward kernels (cuDNN's, flash) accumulate with atomics, so two runs without
replay already differ in the last bits: with the math attention the whole step is
deterministic and replay must match bit for bit (the graphs are captured from the very
calls they replace); with the default cuDNN attention saved for the recompute, replay
must stay within the spread of two runs without it. The plan is pinned: automatic plans
follow measured times, and a layer moved into the fused tail runs other kernels.
"""

from __future__ import annotations

import pytest
import torch

from engine import ModelExecutePlan, RoundPipeRunConfig, wrap_model_to_roundpipe
from engine.accel import graphs
from tests.tiny_models import WIDE, tiny_model
from tests.unit.engine._models import lm_steps

pytestmark = pytest.mark.gpu


def _model() -> torch.nn.Module:
    # head_dim 16 (WIDE): cuDNN's attention runs, so the forward saves it for the recompute
    return tiny_model("qwen3", vocab_size=96, num_hidden_layers=6, dtype=torch.float16, **WIDE)


# embedding + 6 decoder layers + head: the embedding and two decoder layers, three decoder
# layers, the last decoder layer fused with the head; backward in the same two groups
PLAN = ModelExecutePlan.from_ranges(
    [range(0, 3), range(3, 6), range(6, 8)], [range(3, 6), range(0, 3)]
)


def _train(
    *,
    replay: bool,
    grain: str,
    num_microbatch: int,
    steps: int = 3,
    recompute_attention: bool = False,
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, int]]:
    graphs.ENABLED = replay
    graphs.REPLAY_MAX_TOKENS = None
    model = _model()
    rp = wrap_model_to_roundpipe(
        model,
        use_sequential_preset=True,
        optim_dtype=torch.float32,
        model_run_config=RoundPipeRunConfig(
            num_microbatch=num_microbatch, recompute_grain=grain, execute_plan=PLAN
        ),
        recompute_attention=recompute_attention,
    )
    opt = torch.optim.AdamW(rp.optim_parameters(), lr=1e-3)

    def step_fn() -> None:
        opt.step()
        opt.zero_grad()

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (7, 64), generator=g)  # 7 rows: micro-batches of unequal size
    before = graphs.stats()
    losses = lm_steps(rp, [ids] * steps, step_fn)
    after = graphs.stats()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    counts = {k: after[k] - before[k] for k in after}
    return losses, weights, counts


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("num_microbatch", [1, 3])
def test_replay_trains_bit_for_bit_like_the_compiled_calls(
    cuda_devices: int, replay_settings: None, math_attention: None, grain: str, num_microbatch: int
) -> None:
    kwargs = {"grain": grain, "num_microbatch": num_microbatch, "recompute_attention": True}
    got_losses, got, counts = _train(replay=True, **kwargs)
    expected_losses, expected, _ = _train(replay=False, **kwargs)
    again_losses, again, _ = _train(replay=False, **kwargs)
    assert counts["replays"] > 0 and counts["failed"] == 0
    # the oracle is deterministic, or the bit-for-bit comparison below would mean nothing
    assert again_losses == expected_losses
    assert got_losses == expected_losses
    for name, w in expected.items():
        torch.testing.assert_close(again[name], w, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(got[name], w, rtol=0, atol=0, msg=name)


def test_replay_with_saved_cudnn_attention_stays_within_run_to_run_noise(
    cuda_devices: int, replay_settings: None
) -> None:
    """The default path (cuDNN attention saved in the forward, replayed in the recompute):
    after three steps, every weight of the replayed run is as close to a run without replay
    as a second run without replay is (twice that distance at most, per tensor)."""
    got_losses, got, counts = _train(replay=True, grain="stage", num_microbatch=3)
    expected_losses, expected, _ = _train(replay=False, grain="stage", num_microbatch=3)
    _, again, _ = _train(replay=False, grain="stage", num_microbatch=3)
    assert counts["replays"] > 0 and counts["failed"] == 0
    torch.testing.assert_close(got_losses, expected_losses, rtol=1e-4, atol=0)
    for name, w in expected.items():
        noise = (again[name].float() - w.float()).abs().max().item()
        off = (got[name].float() - w.float()).abs().max().item()
        assert off <= 2 * noise, f"{name}: replay {off:.3g} from the run without, noise {noise:.3g}"
