"""Command-line options and plans the LoRA benchmarks share (bench/qlora.py, bench/dpo.py,
bench/train.py's explicit plans)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["WARMUP_STEPS", "add_lora_step_options", "grouped_plan"]

# The one-GPU plan is re-made after the 1st and 3rd timed steps (engine.roundpipe's
# _REPLAN_AFTER_UPDATES): a step measured before the 4th times a re-plan, not the steady
# state (bench/RESULTS.md, session 12: step 3 took twice step 4).
WARMUP_STEPS = 4


def add_lora_step_options(p: argparse.ArgumentParser, *, steps: int) -> None:
    """The step and adapter options of a LoRA benchmark: sequence length, micro-batches,
    measured and warm-up steps, LoRA rank."""
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per row")
    p.add_argument("--num-microbatch", type=int, default=8)
    p.add_argument("--steps", type=int, default=steps, help="measured steps")
    p.add_argument(
        "--warmup",
        type=int,
        default=WARMUP_STEPS,
        help=f"unmeasured first steps (default {WARMUP_STEPS}: the one-GPU plan settles "
        "after the 3rd)",
    )
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument(
        "--baseline-warmup",
        type=int,
        default=None,
        help="warm-up steps of the GPU-resident baseline (default --warmup): it has no plan "
        "to settle, one step warms it",
    )


def grouped_plan(num_layers: int, size: int | None) -> Any:
    """`ModelExecutePlan.grouped(num_layers, size)`, or None (the automatic plan) when
    `size` is not given."""
    if not size:
        return None
    from engine.scheduler import ModelExecutePlan

    return ModelExecutePlan.grouped(num_layers, size)
