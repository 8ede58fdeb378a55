#!/usr/bin/env bash
# GPU correctness in one device call on a 4-GPU machine (issue 43): the GPU suite on 1 GPU
# (cuda 0) and on 2 GPUs (cuda 1,2) at once, the GRPO GPU test alone on GPU 3, and the
# per-device bit check (bench/diag/per_device_bits.py) on GPUs 3 and 2 under inductor's
# default and deterministic modes. Logs and JUnit files go to $OUT.
#   source bench/device_env.sh && OUT=$OUT bash bench/diag/call_tests.sh
set -u
OUT=${OUT:-/tmp/calltests}
mkdir -p "$OUT"
LIMIT=${LIMIT:-540}
PYTEST=(python3 -m pytest -p no:cacheprovider -m gpu -v --timeout=240)
CUDA_VISIBLE_DEVICES=0 timeout "$LIMIT" "${PYTEST[@]}" tests/gpu --ignore=tests/gpu/test_grpo_gpu.py \
    --junitxml="$OUT/one.xml" >"$OUT/one.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1,2 timeout "$LIMIT" "${PYTEST[@]}" tests/gpu --ignore=tests/gpu/test_grpo_gpu.py \
    --junitxml="$OUT/two.xml" >"$OUT/two.log" 2>&1 &
(
    for det in 0 1; do
        for threads in "" --threads; do
            CUDA_VISIBLE_DEVICES=3,2 TORCHINDUCTOR_DETERMINISTIC=$det TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) \
                timeout 120 python3 bench/diag/per_device_bits.py $threads
        done
    done >"$OUT/bits.jsonl" 2>"$OUT/bits.err"
    CUDA_VISIBLE_DEVICES=3 timeout $((LIMIT - 150)) "${PYTEST[@]}" --timeout=300 tests/gpu/test_grpo_gpu.py \
        --junitxml="$OUT/grpo.xml" >"$OUT/grpo.log" 2>&1
) &
wait
for f in one two grpo; do echo "== $f"; tail -3 "$OUT/$f.log"; done
echo "== bits (not equal on another GPU)"
grep -c . "$OUT/bits.jsonl"
grep -v '"cuda1_equal": true' "$OUT/bits.jsonl" | head -40
tail -5 "$OUT/bits.err"
