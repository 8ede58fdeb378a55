"""bench/convergence.py on a few steps: its engine runs are the step modes they claim (the
synchronous and staleness-zero steps train exactly as plain PyTorch, staleness one does not)
and its summary compares each mode with plain PyTorch per seed."""

from __future__ import annotations

import argparse

import pytest

from bench import convergence


@pytest.fixture
def args() -> argparse.Namespace:
    return argparse.Namespace(
        modes=list(convergence.MODES),
        steps=12,
        pretrain_steps=4,
        batch=4,
        seq=32,
        hidden=32,
        layers=1,
        warmup=3,
        num_microbatch=2,
    )


def test_the_step_modes_against_plain_pytorch(args: argparse.Namespace, cpu3: int) -> None:
    start = convergence._pretrain(args, seed=0)
    rows = convergence.run_cell(args, "strong:1e-2", 0, start)
    by_mode = {r["mode"]: r for r in rows}
    for mode in ("sync", "staleness0"):
        assert by_mode[mode]["final_loss"] == pytest.approx(
            by_mode["plain"]["final_loss"], rel=1e-6
        )
        assert by_mode[mode]["held_out_loss"] == pytest.approx(
            by_mode["plain"]["held_out_loss"], rel=1e-6
        )
    assert by_mode["staleness1"]["final_loss"] != pytest.approx(
        by_mode["plain"]["final_loss"], rel=1e-6
    )
    summary = {r["mode"]: r for r in convergence.summarise(rows)}
    assert summary["staleness0"]["final_loss_vs_plain"] == pytest.approx(0, abs=1e-6)
    assert summary["staleness1"]["seeds"] == 1
