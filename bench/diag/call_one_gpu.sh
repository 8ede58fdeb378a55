#!/usr/bin/env bash
# The GPU suite on one GPU in one device call (~9 minutes): every file but the GRPO one under
# a per-test timeout, then the GRPO file alone (it once hung a whole call). Logs and JUnit
# files go to $OUT.
#   source bench/device_env.sh && OUT=$OUT bash bench/diag/call_one_gpu.sh
set -u
OUT=${OUT:-/tmp/calltests}
mkdir -p "$OUT"
SUITE_S=${SUITE_S:-400}
GRPO_S=${GRPO_S:-150}
PYTEST=(python3 -m pytest -p no:cacheprovider -m gpu -v --timeout=200)
timeout "$SUITE_S" "${PYTEST[@]}" tests/gpu --ignore=tests/gpu/test_grpo_gpu.py \
    --junitxml="$OUT/one.xml" >"$OUT/one.log" 2>&1
timeout "$GRPO_S" "${PYTEST[@]}" --timeout=120 tests/gpu/test_grpo_gpu.py \
    --junitxml="$OUT/grpo.xml" >"$OUT/grpo.log" 2>&1
for f in one grpo; do
    echo "== $f"
    grep -E "^(FAILED|ERROR)" "$OUT/$f.log" | head -20
    tail -2 "$OUT/$f.log"
done
