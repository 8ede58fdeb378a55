"""bench/host_lean.py (issue 35) runs end to end with --tiny (tiny shapes, RP_DEVICES=cpu:2),
so the GPU command the lead runs builds the same runs with the real shapes."""

from __future__ import annotations

from bench import host_lean


def test_gpu_cases_use_the_issue_shapes_and_modes() -> None:
    ((name, argv),) = host_lean._runs("14b", tiny=False)
    assert name == "compact" and argv[argv.index("--model") + 1] == "qwen3-14b"
    assert argv[argv.index("--seqs-per-step") + 1] == "32"
    assert argv[argv.index("--seq-len") + 1] == "2048"
    assert "compact" in argv and "bfloat16" in argv
    runs = dict(host_lean._runs("8b", tiny=False))
    assert runs["lean"][runs["lean"].index("--optim-state-dtype") + 1] == "bfloat16"
    runs = dict(host_lean._runs("1.7b", tiny=False))
    steps = runs["fp32_master"]
    assert int(steps[steps.index("--steps") + 1]) + int(steps[steps.index("--warmup") + 1]) == 200
    assert "--optim-memory" not in steps and "--text" in steps
    # Both modes take each gradient at the current weights: compact waits for each layer's
    # update, so the fp32-master reference steps synchronously (no staleness one).
    assert "--sync" in steps and "--sync" not in runs["compact"]
    # a schedule that has settled by the last 20 steps: peak lr, then a cosine decay
    assert steps[steps.index("--lr-min-ratio") + 1] == "0.1"
    assert int(steps[steps.index("--lr-decay-steps") + 1]) >= 20
    seeded = dict(host_lean._runs("1.7b", tiny=False, lr=1e-3, seed=1))["compact"]
    assert seeded[seeded.index("--seed") + 1] == "1" and seeded[seeded.index("--lr") + 1] == "0.001"


def test_tiny_run_reports_every_result_and_comparison() -> None:
    lines = host_lean.main(["--tiny", "--cases", "8b", "1.7b", "--concurrent"])
    rows = {(r["case"], r.get("mode")): r for r in lines}
    compact, lean = rows[("8b", "compact")], rows[("8b", "lean")]
    params = compact["params"]
    # 8-bit codes + block scales, against the lean mode's two bf16 moments
    assert 2 * params < compact["optimizer_state_bytes"] < 2.1 * params
    assert lean["optimizer_state_bytes"] == 4 * params
    assert compact["peak_host_mem_gib"] > 0 and compact["tokens_per_s"] > 0
    assert rows[("8b", None)]["compact_over_lean_tokens_per_s"] > 0
    loss = rows[("1.7b", None)]
    assert loss["final_loss_compact"] < rows[("1.7b", "compact")]["loss_first"]
    assert abs(loss["final_loss_rel_diff"]) < 0.2  # tiny and short: a sanity bound only
    assert isinstance(loss["converged_both"], bool)
    for mode in ("compact", "fp32_master"):
        row = rows[("1.7b", mode)]
        assert len(row["losses_every_10"]) == 4  # steps 0, 10, 20 and the last, 29
        assert abs(row["losses_every_10"][0] - row["loss_first"]) < 1e-4  # 4 decimals
        assert 0 < row["text_unigram_entropy"] < 5 and row["loss_tail_drift"] is not None
    assert rows[("1.7b", "fp32_master")]["async_step"] is False


def test_loss_curve_shows_a_run_on_the_unigram_plateau() -> None:
    """A run that sits at the text's unigram entropy says so (issue 35's first 1.7B call:
    fp32 masters ended at 2.82 nats a byte, the stories' unigram entropy 2.88)."""
    stuck = [12.0 - k for k in range(9)] + [2.85] * 191
    curve = host_lean.loss_curve({"losses": stuck, "text_unigram_entropy": 2.88})
    assert curve["first_step_below_unigram"] is None
    assert curve["losses_every_10"][:2] == [12.0, 2.85] and len(curve["losses_every_10"]) == 21
    assert curve["loss_tail_drift"] == 0.0
    assert not host_lean._converged(curve)
    learnt = [12.0 - k for k in range(9)] + [2.0] * 11 + [0.4] * 180
    curve = host_lean.loss_curve({"losses": learnt, "text_unigram_entropy": 2.88})
    assert curve["first_step_below_unigram"] == 9
    assert host_lean._converged(curve)
    falling = [3.0 * 0.99**k for k in range(200)]  # 10% lower every 10 steps at the end
    curve = host_lean.loss_curve({"losses": falling, "text_unigram_entropy": 2.88})
    assert curve["loss_tail_drift"] < -0.09 and not host_lean._converged(curve)
