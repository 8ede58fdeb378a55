#!/usr/bin/env bash
# One-GPU device calls for what session 26 left unmeasured (each ~9 minutes; logs to $OUT):
#   PART=grpo  issue 48: the 8B engine step with the CUDA-graph decode step (the default;
#              the eager loop's figures: 56.2 s session 25, 43.4 s on the x2 host session
#              27); each step's line says whether the graph survived its check
#   PART=trl   issue 48: TRL's 8B step, a warm-up step first (session 26 measured only its
#              first step, 85.2 s, in the call's time), then the small batch beside the
#              engine. Needs `WITH_TRL=1 bash bench/fetch_wheels.sh`.
#   PART=fp8   issue 49: the reference test of the three recipes with each one's farthest
#              gradients printed (session 26: tensorwise 0.03-0.11 from the reference, the
#              rowwise ones pass, their distances unknown), then the 1.7B stage
#              (`STAGES=1.7b bash bench/fp8.sh`).
#   source bench/device_env.sh && PART=grpo OUT=$OUT bash bench/diag/call_open.sh
set -u
OUT=${OUT:-/tmp/callopen}
mkdir -p "$OUT"
case ${PART:-grpo} in
grpo)
    # the graph tests passed in session 27; session 28's 8B run ended in its 240 s limit
    # after the warm-up step (124 s with the capture): give the measured step room
    timeout 480 python3 bench/grpo.py --model qwen3-8b --runs engine --steps 1 --warmup 1 \
        >"$OUT/grpo-8b-graphs.jsonl" 2>"$OUT/grpo-8b-graphs.err"
    cut -c1-1500 "$OUT/grpo-8b-graphs.jsonl"
    grep -h "grpo bench\|checked\|graph rollouts failed\|decode eagerly" "$OUT/grpo-8b-graphs.err" | tail -8
    ;;
trl)
    timeout 330 python3 bench/grpo.py --model qwen3-8b --runs trl --steps 1 --warmup 1 \
        >"$OUT/grpo-trl.jsonl" 2>"$OUT/grpo-trl.err"
    timeout 230 python3 bench/grpo.py --model qwen3-8b --runs trl,engine --prompts 8 \
        --completion-len 256 --steps 1 --warmup 1 >"$OUT/grpo-small.jsonl" 2>"$OUT/grpo-small.err"
    cat "$OUT"/grpo-trl.jsonl "$OUT"/grpo-small.jsonl
    grep -h "grpo bench" "$OUT"/grpo-trl.err "$OUT"/grpo-small.err | tail -12
    ;;
fp8)
    timeout 200 python3 -m pytest -p no:cacheprovider -m gpu -v --tb=long --timeout=150 \
        "tests/gpu/test_fp8_gpu.py::test_fp8_layers_equal_the_fp8_reference" -s \
        --junitxml="$OUT/fp8-ref.xml" >"$OUT/fp8-ref.log" 2>&1
    grep -E "PASSED|FAILED|farthest gradients" "$OUT/fp8-ref.log" | cut -c1-400 | head -9
    # tensorwise's forward GEMM is cuBLASLt's with fast accumulation, whose kernel choice
    # (and rounding) may follow the operands' alignment, which differs between the engine's
    # buffers and the reference's tensors; the rowwise recipes use another kernel. Again
    # without fast accumulation: if tensorwise then passes, that is the difference.
    timeout 100 python3 - >"$OUT/fp8-ref-slow.log" 2>&1 <<'PY'
import sys

import pytest

import engine.accel.fp8 as fp8

scaled_mm = fp8._scaled_mm
fp8._scaled_mm = lambda a, sa, b, sb, *, fast: scaled_mm(a, sa, b, sb, fast=False)
test = "tests/gpu/test_fp8_gpu.py::test_fp8_layers_equal_the_fp8_reference[tensorwise]"
sys.exit(pytest.main(["-p", "no:cacheprovider", "-m", "gpu", "-s", "-q", test]))
PY
    grep -E "passed|failed|farthest gradients" "$OUT/fp8-ref-slow.log" | cut -c1-400 | head -3
    STAGES=1.7b timeout 290 bash bench/fp8.sh >"$OUT/fp8-17b.jsonl" 2>"$OUT/fp8-17b.err"
    grep -h "tokens_per_s\"" "$OUT/fp8-17b.jsonl" | cut -c1-300
    ;;
esac
