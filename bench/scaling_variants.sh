#!/usr/bin/env bash
# Where 4 GPUs lose against one (issue 43, after session 21): the same Qwen3-1.7B step
# (SEQS x 2048 tokens, NMB micro-batches) on 4 GPUs in variants that each remove one
# suspect, against one GPU, in one call (bench/RESULTS.md, session 21: the host links give
# each of 4 GPUs 60-66% of a lone GPU's bandwidth; the plan made from measured times takes
# over at step 6 and costs ~20 s):
#   one         1 GPU, the reference
#   four        4 GPUs as the engine plans them (steps 0-9: the time plan's steady state)
#   four_reatt  4 GPUs, attention recomputed (no saved attention: 28 GiB less each way)
#   four_g7     4 GPUs, an explicit plan of 7-layer groups (the simulation's best even plan)
#   four_ov     4 GPUs, overlapped calls (session 27's 2-GPU profile: the call boundary's
#               fill and drain are most of the idle time)
#   OUT=$OUT ONLY="one four four_reatt four_g7 four_ov" bash bench/scaling_variants.sh
set -u
OUT=${OUT:-/tmp/scaling_variants}
mkdir -p "$OUT"
SEQS=${SEQS:-128}
NMB=${NMB:-8}
ARGS=(--seqs-per-step "$SEQS" --num-microbatch "$NMB" --warmup "${WARMUP:-3}")
PREFIX=variants-
# shellcheck source=bench/run_logged.sh
source "$(dirname "$0")/run_logged.sh"
run one "${T_ONE:-120}" env RP_DEVICES=cuda:0 python3 bench/train.py "${ARGS[@]}" --steps 3
run four "${T_FOUR:-150}" env RP_DEVICES=cuda python3 bench/train.py "${ARGS[@]}" --steps 7
run four_reatt "${T_FOUR:-150}" env RP_DEVICES=cuda python3 bench/train.py "${ARGS[@]}" \
    --steps 7 --recompute-attention
run four_g7 "${T_FOUR:-150}" env RP_DEVICES=cuda python3 bench/train.py "${ARGS[@]}" \
    --steps 7 --group-layers 7
run four_ov "${T_FOUR:-150}" env RP_DEVICES=cuda python3 bench/train.py "${ARGS[@]}" \
    --steps 7 --overlap-calls
