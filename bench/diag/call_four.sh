#!/usr/bin/env bash
# Device calls on nvidia-h200-x4 / nvidia-h100-x4 (issue 43; session 27 wrote them, none ran
# yet; logs and JUnit files to $OUT):
#   PART=suite_a  the GPU suite's first half with all 4 GPUs visible (the issue: "the whole
#                 GPU suite passes with 1, 2 and 4 visible GPUs"; 1 and 2: bench/diag/call_tests.sh)
#   PART=suite_b  its second half
#   PART=scaling  1 GPU against 4 (as planned, with overlapped calls), then NCCL data parallel
#                 over 4 ranks, every run in one call (bench/scaling_variants.sh, bench/scaling.sh)
#   source bench/device_env.sh && PART=suite_a OUT=$OUT bash bench/diag/call_four.sh
set -u
OUT=${OUT:-/tmp/callfour}
mkdir -p "$OUT"
PYTEST=(python3 -m pytest -p no:cacheprovider -m gpu -v --tb=short --timeout=240)
mapfile -t FILES < <(ls tests/gpu/test_*_gpu.py)
HALF=$(( ${#FILES[@]} / 2 ))
case ${PART:-suite_a} in
suite_a | suite_b)
    if [ "$PART" = suite_a ]; then part=("${FILES[@]:0:$HALF}"); else part=("${FILES[@]:$HALF}"); fi
    timeout 560 "${PYTEST[@]}" "${part[@]}" --junitxml="$OUT/$PART.xml" >"$OUT/$PART.log" 2>&1
    grep -E "FAILED|ERROR" "$OUT/$PART.log" | cut -c1-300 | head -20
    tail -3 "$OUT/$PART.log"
    ;;
scaling)
    ONLY="one four four_ov" T_ONE=120 T_FOUR=140 OUT=$OUT bash bench/scaling_variants.sh
    ONLY=dp4 T_DP=140 OUT=$OUT bash bench/scaling.sh
    python3 bench/diag/train_summary.py "$OUT"/variants-*.log "$OUT"/scaling-dp4.log 2>/dev/null
    ;;
esac
