#!/usr/bin/env bash
# Multi-node jobs' rank entry point under torchrun on one multi-GPU box (issue 47; docs/SCALING.md):
# two torchrun agents (--nnodes 2 --nproc-per-node 1 --rdzv-backend c10d), one GPU each, run
# `python -m rp_service.cluster.rank` as Ray's rank agents do on two machines; against one
# agent at the same batch per node. Qwen3-1.7B shape, JSON lines (bench/multinode.py):
#   shared      NCCL as the box offers it (NVLink / PCIe, shared memory)
#   network     NCCL over sockets only (NCCL_SHM_DISABLE, NCCL_P2P_DISABLE): two machines' path
# Each run's log goes to $OUT/<name>.log; its JSON lines are echoed. ONLY="a b" runs those.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/multinode}
mkdir -p "$OUT"
ARGS=(--steps "${STEPS:-5}" --warmup "${WARMUP:-3}" --work-dir "$OUT/work")
# shellcheck source=bench/run_logged.sh
source bench/run_logged.sh
run shared "${T_RUN:-560}" python3 bench/multinode.py --nodes 1 2 "${ARGS[@]}"
run network "${T_RUN:-560}" python3 bench/multinode.py --nodes 1 2 --network "${ARGS[@]}"
