#!/usr/bin/env bash
# Issue 44 on one H100/H200 in one call (~8 minutes): Qwen3-1.7B full fine-tune
# (bench/train.py defaults: fp32 masters, 64 x 2048 tokens a step, 4 micro-batches), the
# asynchronous step with staleness one beside staleness zero, with and without the daemon's
# clip (engine.optim.Adam.clip_grad_norm_ 1.0); bench/train.py JSON lines. Compare
# tokens_per_s within a pair (target: staleness zero >= 0.97x); optimizer_thread_s
# (fold_s, first_layer_s, folded_ahead, deferred) and fold_ahead_s (the fold during the
# backward: fold_s, params, end_wait_s) say where the staleness-zero step's time before
# layer 0 goes.
#   clip           staleness 1 and 0, --grad-clip 1.0                      (~4 min)
#   noclip         staleness 1 and 0, no clip                               (~4 min)
# Not in the default call:
#   ab             staleness 0 with clip and --no-fold-ahead (the fold and the norm in the
#                  step, as before engine/fold_ahead.py)                    (~2 min)
#   copied         staleness 1 and 0, --grad-clip 1.0 and --copy-grads (every gradient
#                  copied into the fp32 buffer, as before engine/optim/_deferred.py: the
#                  baseline of the deferred copies, fold_ahead_s end_wait_s and
#                  optimizer_thread_s first_layer_s against the clip stage's) (~4 min)
#   source bench/device_env.sh; bash bench/staleness.sh
#   STAGES="clip ab" bash bench/staleness.sh
#   STAGES="clip copied" bash bench/staleness.sh      (the deferred copies' A/B, ~8 min)
#   MODEL=tiny28 EXTRA="--seq-len 32 --seqs-per-step 4" bash bench/staleness.sh   (CPU check)
set -u
OUT=${OUT:-/tmp/staleness}
mkdir -p "$OUT"
STAGES=${STAGES:-"clip noclip"}
PREFIX=staleness-
# shellcheck source=bench/run_logged.sh
source "$(dirname "$0")/run_logged.sh"

has() { [[ " $STAGES " == *" $1 "* ]]; }
# shellcheck disable=SC2206  # EXTRA: extra bench/train.py arguments, split on spaces
T=(python3 bench/train.py --model "${MODEL:-qwen3-1.7b}" --warmup 2 --steps 4 ${EXTRA:-})
CLIP=(--grad-clip 1.0)

if has clip; then
    run clip-s1 150 "${T[@]}" "${CLIP[@]}" --step-staleness 1
    run clip-s0 150 "${T[@]}" "${CLIP[@]}" --step-staleness 0
fi
if has noclip; then
    run noclip-s1 150 "${T[@]}" --step-staleness 1
    run noclip-s0 150 "${T[@]}" --step-staleness 0
fi
if has ab; then
    run clip-s0-no-fold-ahead 150 "${T[@]}" "${CLIP[@]}" --step-staleness 0 --no-fold-ahead
fi
if has copied; then
    run clip-s1-copied 150 "${T[@]}" "${CLIP[@]}" --step-staleness 1 --copy-grads
    run clip-s0-copied 150 "${T[@]}" "${CLIP[@]}" --step-staleness 0 --copy-grads
fi
