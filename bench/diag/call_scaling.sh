#!/usr/bin/env bash
# One 4-GPU device call (issue 43, session 21): the host links' bandwidth, the device-count
# and multi-node GPU tests on all four GPUs, then bench/train.py on 1 and on 4 GPUs (the
# scaling pair, one call). Logs and JSON lines go to $OUT.
#   source bench/device_env.sh && OUT=$OUT bash bench/diag/call_scaling.sh
set -u
OUT=${OUT:-/tmp/callscaling}
mkdir -p "$OUT"
nvidia-smi topo -m >"$OUT/topo.txt" 2>&1
lscpu | grep -iE "numa|socket|model name" >>"$OUT/topo.txt"
timeout 40 python3 bench/host_links.py --gib 1 --repeat 4 >"$OUT/links.jsonl" 2>"$OUT/links.err"
timeout 140 python3 -m pytest -p no:cacheprovider -m gpu -v -s --timeout=120 \
    tests/gpu/test_device_count_gpu.py tests/gpu/test_multinode_gpu.py >"$OUT/tests.log" 2>&1
ARGS=(--seqs-per-step 128 --num-microbatch 8 --warmup 3)
RP_DEVICES=cuda:0 timeout 115 python3 bench/train.py "${ARGS[@]}" --steps 3 >"$OUT/one.jsonl" 2>"$OUT/one.err"
RP_DEVICES=cuda timeout 120 python3 bench/train.py "${ARGS[@]}" --steps 4 >"$OUT/four.jsonl" 2>"$OUT/four.err"
cat "$OUT/topo.txt" "$OUT/links.jsonl"
grep -E "PASSED|FAILED|passed|failed|apart" "$OUT/tests.log" | tail -8
for f in one four; do python3 bench/diag/train_summary.py "$OUT/$f.jsonl"
tail -2 "$OUT/$f.err"; done
