#!/usr/bin/env bash
# One device call (~9 minutes, one H100/H200) for what session 24 changed on the CPU and could
# not run on a GPU: the FP8 tests (the reference test now recomputes attention; the
# rowwise_with_gw_hp recipe), the GRPO GPU file (the draw on the device, the packed NF4
# sampler, the seven sampler tests never reached), then one rollout token's draw on the GPU.
# Logs and JUnit files go to $OUT.
#   bash bench/fetch_wheels.sh   (here, once)
#   source bench/device_env.sh && OUT=$OUT bash bench/diag/call_unrun.sh
set -u
OUT=${OUT:-/tmp/unrun}
mkdir -p "$OUT"
PYTEST=(python3 -m pytest -p no:cacheprovider -m gpu -v --tb=short)
timeout 200 "${PYTEST[@]}" --timeout=150 tests/gpu/test_fp8_gpu.py \
    --junitxml="$OUT/fp8.xml" >"$OUT/fp8.log" 2>&1
timeout 330 "${PYTEST[@]}" --timeout=220 --durations=0 tests/gpu/test_grpo_gpu.py \
    --junitxml="$OUT/grpo.xml" >"$OUT/grpo.log" 2>&1
timeout 60 python3 bench/rollout_draw.py >"$OUT/draw.jsonl" 2>"$OUT/draw.err"
for f in "$OUT"/fp8.log "$OUT"/grpo.log; do
    echo "== $f"
    grep -E "^(FAILED|ERROR)" "$f" | head -20
    tail -1 "$f"
done
cat "$OUT/draw.jsonl"
