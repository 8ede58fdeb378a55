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


def test_tiny_run_reports_every_result_and_comparison() -> None:
    lines = host_lean.main(["--tiny", "--cases", "8b", "1.7b"])
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
