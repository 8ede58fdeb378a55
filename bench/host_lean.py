"""Issue 35's benchmark: the compact host-memory mode (RoundPipe optim_memory='compact':
bf16 weights as the masters, 8-bit Adam moments, the bf16 gradient in place).

One JSON line per result (each run is bench/train.py in its own process, so every peak host
memory figure is that run's alone), then one line per comparison:

  14b          Qwen3-14B shape, 32 x 2048 tokens a step, compact: tokens/s, peak host memory
               (RSS) against the plan's prediction; the issue asks <= 112 GiB, >= 4,800 tok/s
  8b           Qwen3-8B shape, the same tokens: compact against the 12-byte lean mode (bf16
               moments, the half gradient in place, fp32 masters); within 5% of its tok/s
  1.7b         Qwen3-1.7B shape, 200 steps of generated text (the demo's stories; the
               schedule at ACCURACY), a pair for each of --lrs and --seeds: the final loss
               (mean of the last 20 steps) of compact against the fp32-master path (fp32
               masters and moments, stepped synchronously as compact is: see
               FP32_MASTER); within 1%. Each row carries its loss every 10 steps, the
               first step below 90% of the text's unigram entropy (2.88 nats a byte: a
               model that learned only the byte frequencies) and the drift of its last
               20 steps; the comparison says whether both runs converged (left the
               plateau, tail drift under 1%), the condition for a 1% comparison to mean
               something

On the GPU box (one H100, 125 GiB host):

    python bench/host_lean.py                    # all three cases, ~25 min
    python bench/host_lean.py --cases 14b 8b     # the throughput cases only
    python bench/host_lean.py --cases 1.7b --concurrent             # one pair at once (~6.5 min)
    python bench/host_lean.py --cases 1.7b --concurrent --seeds 1   # the noise floor's pair

On a CPU (tiny shapes, RP_DEVICES=cpu:2, seconds): `python bench/host_lean.py --tiny`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# Options every run shares: bf16 model, pinned arena, attention recomputed (the saved
# attention outputs alone are 25.6 GiB of host memory at 14B and 32 x 2048 tokens).
COMMON = ["--dtype", "bfloat16", "--pin-model", "arena", "--recompute-attention"]
COMPACT = ["--optim-memory", "compact"]
LEAN = ["--optim-state-dtype", "bfloat16", "--optim-grad-dtype", "model"]  # 12 bytes
# fp32 masters, fp32 moments, fp32 gradient buffer (20 bytes), stepped synchronously: the
# compact step publishes each layer as the optimizer updates it and the next call waits for
# it, so every compact gradient is taken at the current weights; the default asynchronous
# fp32-master step takes each one at the weights of the step before (staleness one), a
# different algorithm. On the first H100 call (asynchronous) that alone put the fp32 run at
# 2.82 nats a byte against compact's 0.35. A CPU replay of the recipe (qwen3-small, 8 x 64
# tokens, lr 3e-4, seed 0; mean of the last 20 losses): fp32 masters asynchronous 1.226,
# synchronous 0.408, torch AdamW on fp32 weights (bf16 autocast) 0.407, compact 0.397.
FP32_MASTER = ["--sync"]

THROUGHPUT = ["--seqs-per-step", "32", "--seq-len", "2048", "--steps", "3", "--warmup", "4"]
# 200 steps of the demo's stories (bytes): a 10-step warm-up, the peak lr until step 150,
# then a cosine decay to a tenth of it over the last 50 steps, so the last 20 losses are
# those of a run that has settled. The first recipe (constant lr 3e-4) ended both runs in
# the middle of their fall through the stories' structure (the last 20 losses drifting
# -21% and -13%), where a few steps' lead or lag read as 8% (H100, session 14); a cosine
# decay over all 190 steps (6e-4, 8 x 1024 tokens) slowed the fall before it ended.
ACCURACY = [
    *("--seqs-per-step", "8", "--seq-len", "2048", "--steps", "190", "--warmup", "10"),
    *("--text", "--lr-warmup-steps", "10", "--lr-min-ratio", "0.1", "--lr-decay-steps", "50"),
]
ACCURACY_LRS = (6e-4,)
TINY_THROUGHPUT = ["--seqs-per-step", "8", "--seq-len", "32", "--steps", "3", "--warmup", "1"]
TINY_ACCURACY = [
    *("--seqs-per-step", "8", "--seq-len", "32", "--steps", "25", "--warmup", "5"),
    *("--text", "--lr-warmup-steps", "5", "--lr-min-ratio", "0.1", "--lr-decay-steps", "10"),
]
TINY_ACCURACY_LRS = (3e-3,)


def _runs(
    case: str, tiny: bool, lr: float | None = None, seed: int = 0
) -> list[tuple[str, list[str]]]:
    """(name, bench/train.py arguments) of one case (1.7b: at peak learning rate `lr`,
    initialisation and batch order `seed`)."""
    throughput = TINY_THROUGHPUT if tiny else THROUGHPUT
    accuracy = TINY_ACCURACY if tiny else ACCURACY
    model = {"14b": "qwen3-14b", "8b": "qwen3-8b", "1.7b": "qwen3-1.7b"}[case]
    if tiny:
        model = "tiny"
    base = ["--model", model, *COMMON]
    if case == "14b":
        return [("compact", [*base, *throughput, *COMPACT])]
    if case == "8b":
        return [("compact", [*base, *throughput, *COMPACT]), ("lean", [*base, *throughput, *LEAN])]
    if lr is None:
        lr = (TINY_ACCURACY_LRS if tiny else ACCURACY_LRS)[0]
    accuracy = [*accuracy, "--lr", str(lr), "--seed", str(seed)]
    return [
        ("compact", [*base, *accuracy, *COMPACT]),
        ("fp32_master", [*base, *accuracy, *FP32_MASTER]),
    ]


def start_train(argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """bench/train.py with `argv` in a fresh process."""
    return subprocess.Popen(
        [sys.executable, "-m", "bench.train", *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def train_result(proc: subprocess.Popen[str], argv: list[str]) -> dict[str, Any]:
    """The result line of a run started by start_train, once it ends."""
    stdout, stderr = proc.communicate()
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bench/train.py {' '.join(argv)} failed:\n{stderr[-4000:]}")
    return dict(json.loads(lines[-1]))


def _summary(case: str, name: str, result: dict[str, Any]) -> dict[str, Any]:
    plan = result.get("plan_host_parts_gib") or {}
    return {
        "bench": "host_lean",
        "case": case,
        "mode": name,
        **({k: result[k] for k in ("lr", "seed")} if case == "1.7b" else {}),
        "model": result["model"],
        "params": result["params"],
        "tokens_per_step": result["tokens_per_step"],
        "tokens_per_s": result["tokens_per_s"],
        "peak_host_mem_gib": result["peak_host_mem_gib"],
        "plan_host_gib": result.get("plan_host_gib"),
        "plan_host_parts_gib": plan,
        "optimizer_state_bytes": result.get("optimizer_state_bytes"),
        "optimizer_s_median": result.get("optimizer_s_median"),
        "loss_first": result["loss_first"],
        "loss_tail_mean": result.get("loss_tail_mean"),
        "async_step": result.get("async_step"),
        **loss_curve(result),
        "peak_gpu_mem_gib": result.get("peak_gpu_mem_gib"),
        "device": result["device"],
    }


def loss_curve(result: dict[str, Any]) -> dict[str, Any]:
    """What a run's losses did, in a line a reader can scan: every 10th loss (and the last),
    the text's unigram entropy (the plateau of a model that has learned only the byte
    frequencies) and the first step below 90% of it (None: the run never left it), and
    the tail's drift (mean of the last 10 losses over the 10 before, minus 1: a final loss
    still falling by several % is no converged figure to compare at 1%)."""
    losses = result.get("losses") or []
    if not losses:
        return {}
    entropy = result.get("text_unigram_entropy")
    below = None
    if entropy:
        below = next((k for k, x in enumerate(losses) if x < 0.9 * entropy), None)
    drift = None
    if len(losses) >= 20:
        drift = round(sum(losses[-10:]) / sum(losses[-20:-10]) - 1, 4)
    return {
        "losses_every_10": [*losses[::10], losses[-1]] if (len(losses) - 1) % 10 else losses[::10],
        "text_unigram_entropy": entropy,
        "first_step_below_unigram": below,
        "loss_tail_drift": drift,
    }


# A run's final loss is a figure to compare at 1% when the run has left the unigram
# plateau and its loss moved by less than this over its last 20 steps (loss_tail_drift).
CONVERGED_DRIFT = 0.01


def _converged(row: dict[str, Any]) -> bool:
    drift = row.get("loss_tail_drift")
    left = row.get("first_step_below_unigram") is not None
    return left and drift is not None and abs(drift) < CONVERGED_DRIFT


def compare(case: str, rows: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The case's comparison line (8b: tok/s ratio; 1.7b: final-loss difference)."""
    if case == "8b":
        ratio = rows["compact"]["tokens_per_s"] / rows["lean"]["tokens_per_s"]
        return {
            "bench": "host_lean",
            "case": case,
            "compact_over_lean_tokens_per_s": round(ratio, 4),
        }
    if case == "1.7b":
        got, ref = rows["compact"]["loss_tail_mean"], rows["fp32_master"]["loss_tail_mean"]
        return {
            "bench": "host_lean",
            "case": case,
            "lr": rows["compact"]["lr"],
            "seed": rows["compact"]["seed"],
            "final_loss_compact": got,
            "final_loss_fp32_master": ref,
            "final_loss_rel_diff": round((got - ref) / ref, 5),
            "converged_both": all(_converged(rows[m]) for m in ("compact", "fp32_master")),
        }
    return None


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--cases", nargs="+", choices=["14b", "8b", "1.7b"], default=["14b", "8b", "1.7b"]
    )
    p.add_argument("--tiny", action="store_true", help="tiny shapes on RP_DEVICES=cpu:2")
    p.add_argument(
        "--lrs",
        nargs="+",
        type=float,
        default=None,
        help=f"1.7b: one pair of runs at each peak learning rate (default {ACCURACY_LRS[0]})",
    )
    p.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        default=[0],
        help="1.7b: one pair of runs for each seed (initialisation and batch order); two "
        "seeds show how far one run lands from another by chance",
    )
    p.add_argument(
        "--concurrent",
        action="store_true",
        help="start every run at once (for the 1.7b losses: the runs share the GPU and the "
        "cores, so their tokens/s and host peaks are no figures to quote; two 1.7B runs "
        "take ~380 s on the H100 box, four ran past its 10-minute cap)",
    )
    args = p.parse_args(argv)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if args.tiny:
        env["RP_DEVICES"] = "cpu:2"
    groups = []  # (case, runs): the 1.7b case once per learning rate and seed
    for case in args.cases:
        if case != "1.7b":
            groups.append((case, _runs(case, args.tiny)))
            continue
        for lr in args.lrs or [None]:
            groups.extend((case, _runs(case, args.tiny, lr, seed)) for seed in args.seeds)
    started: dict[tuple[int, str], subprocess.Popen[str]] = {}
    if args.concurrent:
        for k, (_, runs) in enumerate(groups):
            started.update({(k, name): start_train(run_argv, env) for name, run_argv in runs})
    out = []
    for k, (case, runs) in enumerate(groups):
        rows = {}
        for name, run_argv in runs:
            proc = started.get((k, name)) or start_train(run_argv, env)
            rows[name] = _summary(case, name, train_result(proc, run_argv))
            print(json.dumps(rows[name]), flush=True)
            out.append(rows[name])
        line = compare(case, rows)
        if line is not None:
            print(json.dumps(line), flush=True)
            out.append(line)
    return out


if __name__ == "__main__":
    main()
