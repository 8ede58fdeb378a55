#!/usr/bin/env bash
# One process driving 1, 2 and 4 GPUs (and NCCL data parallel over 2 and 4 ranks): the
# bench/train.py Qwen3-1.7B shape at SEQS x 2048 tokens a step, every run in one call so
# the ratios compare on one machine (bench/RESULTS.md, "Several GPUs").
#   SEQS=128 NMB=8 ONLY="one two four" bash bench/scaling.sh
# Each run's log goes to $OUT/scaling-<name>.log; its JSON line is echoed.
set -u
OUT=${OUT:-/tmp/scaling}
mkdir -p "$OUT"
SEQS=${SEQS:-128}
NMB=${NMB:-8}
ARGS=(--seqs-per-step "$SEQS" --num-microbatch "$NMB" --steps "${STEPS:-4}" --warmup "${WARMUP:-3}")
PREFIX=scaling-
# shellcheck source=bench/run_logged.sh
source "$(dirname "$0")/run_logged.sh"
run one "${T_ONE:-200}" env RP_DEVICES=cuda:0 python3 bench/train.py "${ARGS[@]}"
run two "${T_TWO:-150}" env RP_DEVICES=cuda:0,1 python3 bench/train.py "${ARGS[@]}"
run four "${T_FOUR:-150}" env RP_DEVICES=cuda python3 bench/train.py "${ARGS[@]}"
run dp4 "${T_DP:-150}" python3 -m torch.distributed.run --nproc-per-node 4 \
    --master-port 29514 bench/train.py "${ARGS[@]}"
run dp2 "${T_DP:-150}" python3 -m torch.distributed.run --nproc-per-node 2 \
    --master-port 29513 bench/train.py "${ARGS[@]}"
