#!/usr/bin/env bash
# Data parallel on one box (bench/RESULTS.md, "Data parallel over torch.distributed"):
# the bench/train.py Qwen3-1.7B shape, 131,072 tokens a step (global), in priority order:
#   dp2_sharded     two processes, one GPU each (NCCL), ZeRO-1 sharded optimizer state
#   one_gpu         one process, one GPU
#   dp2_replicated  two processes, every rank keeping the whole optimizer state
#   one_proc_2gpu   one process driving both GPUs
# Each run's log goes to $OUT/<name>.log; its JSON line is echoed. ONLY="a b" runs those.
set -u
OUT=${OUT:-/tmp/dp_scaling}
mkdir -p "$OUT"
ARGS=(--steps "${STEPS:-3}" --warmup "${WARMUP:-3}")
# shellcheck source=bench/run_logged.sh
source "$(dirname "$0")/run_logged.sh"
TORCHRUN=(python3 -m torch.distributed.run --nproc-per-node 2 --master-port 29512)
run dp2_sharded "${T_DP:-110}" "${TORCHRUN[@]}" bench/train.py "${ARGS[@]}"
run one_gpu "${T_ONE:-120}" env RP_DEVICES=cuda:0 python3 bench/train.py "${ARGS[@]}"
run dp2_replicated "${T_DP:-110}" "${TORCHRUN[@]}" bench/train.py "${ARGS[@]}" --no-shard-optimizer
run one_proc_2gpu "${T_TWO:-100}" python3 bench/train.py "${ARGS[@]}"
