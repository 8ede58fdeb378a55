#!/usr/bin/env bash
# Issue 49 on one H100/H200 in one call (< 9 minutes): the per-matmul-shape profile, then each
# FP8 run beside its bf16 twin (bf16 models, 2048-token sequences, bench/train.py JSON lines):
#   micro          bench/fp8_matmul.py: the decoder's shapes of 1.7B and 8B, bf16 vs FP8
#                  rowwise / tensorwise, with and without the casts                (~30 s)
#   layer          bench/fp8_layer.py: one compiled 1.7B decoder layer, forward and backward
#                  (recompute + gradients) per precision, and a per-kernel torch.profiler
#                  table of its backward: GEMMs, fused casts, attention, the rest  (~1.5 min)
#   1.7b           Qwen3-1.7B full fine-tune: bf16, fp8 rowwise, fp8 tensorwise,
#                  fp8 rowwise_with_gw_hp (the weight gradient in bf16)          (~4 min)
#   8b             Qwen3-8B full fine-tune, 12-byte mode: bf16, fp8 rowwise       (~1.5 min)
#   8b-lora        Qwen3-8B LoRA: bf16, fp8 rowwise                               (~1.5 min)
# The 8B runs keep the first LAYERS8B (12) of the 36 decoder layers to fit the call: the
# per-layer work is the full model's, the bf16 embedding and head weigh 3x more, so the FP8
# ratio is a lower bound (LAYERS8B=36 for the whole model, ~3x the time).
# Not in the default call:
#   loss           Qwen3-1.7B, 200 steps of the demo's stories (bench/host_lean.py's
#                  recipe) for each of SEEDS: bf16, fp8 rowwise, fp8 tensorwise (~2.5 min
#                  a run, 3 runs a seed)
#   70b-qlora      the recorded Llama-3.3-70B-shaped QLoRA recipe (bench/RESULTS.md: 1,500
#                  tokens/s): bf16, fp8 rowwise (~4 min a run, 72 GiB of host memory)
#   source bench/device_env.sh; bash bench/fp8.sh
#   STAGES="micro layer 1.7b" bash bench/fp8.sh;  STAGES=loss SEEDS="0 1 2" bash bench/fp8.sh
set -u
OUT=${OUT:-/tmp/fp8}
mkdir -p "$OUT"
STAGES=${STAGES:-"micro layer 1.7b 8b 8b-lora"}
SEEDS=${SEEDS:-"0 1 2"}
LAYERS8B=${LAYERS8B:-12}
PREFIX=fp8-
# shellcheck source=bench/run_logged.sh
source "$(dirname "$0")/run_logged.sh"

has() { [[ " $STAGES " == *" $1 "* ]]; }
T=(python3 bench/train.py --dtype bfloat16 --warmup 2 --steps 3)
BF16=(--matmul-precision bf16)
ROW=(--matmul-precision fp8 --fp8-recipe rowwise)
TENSOR=(--matmul-precision fp8 --fp8-recipe tensorwise)
GWHP=(--matmul-precision fp8 --fp8-recipe rowwise_with_gw_hp)
LEAN=(--optim-state-dtype bfloat16 --optim-grad-dtype model --pin-model arena --recompute-attention)

if has micro; then
    run micro 120 python3 bench/fp8_matmul.py --models qwen3-1.7b qwen3-8b --tokens 16384
fi
if has layer; then
    run layer 180 python3 bench/fp8_layer.py --model qwen3-1.7b --tokens 16384
fi
if has 1.7b; then
    A=(--model qwen3-1.7b --seqs-per-step 32)
    run 1.7b-bf16 150 "${T[@]}" "${A[@]}" "${BF16[@]}"
    run 1.7b-rowwise 150 "${T[@]}" "${A[@]}" "${ROW[@]}"
    run 1.7b-tensorwise 150 "${T[@]}" "${A[@]}" "${TENSOR[@]}"
    run 1.7b-gwhp 150 "${T[@]}" "${A[@]}" "${GWHP[@]}"
fi
if has 8b; then
    A=(--model qwen3-8b --layers "$LAYERS8B" --seqs-per-step 32 "${LEAN[@]}")
    run 8b-bf16 180 "${T[@]}" "${A[@]}" "${BF16[@]}"
    run 8b-rowwise 180 "${T[@]}" "${A[@]}" "${ROW[@]}"
fi
if has 8b-lora; then
    A=(--model qwen3-8b --layers "$LAYERS8B" --lora --seqs-per-step 32)
    run 8b-lora-bf16 150 "${T[@]}" "${A[@]}" "${BF16[@]}"
    run 8b-lora-rowwise 150 "${T[@]}" "${A[@]}" "${ROW[@]}"
fi
if has 70b-qlora; then
    Q=(python3 bench/qlora.py --model llama-70b --seqs-per-step 16 --num-microbatch 4
        --group-layers 2 --recompute-attention --warmup 2 --steps 2)
    run 70b-qlora-bf16 420 "${Q[@]}" "${BF16[@]}"
    run 70b-qlora-rowwise 420 "${Q[@]}" "${ROW[@]}"
fi
if has loss; then
    # bench/host_lean.py's ACCURACY recipe: 8 x 2048 bytes a step, 190 + 10 steps, lr 6e-4
    L=(python3 bench/train.py --model qwen3-1.7b --dtype bfloat16 --pin-model arena
        --recompute-attention --seqs-per-step 8 --seq-len 2048 --steps 190 --warmup 10 --text
        --lr 6e-4 --lr-warmup-steps 10 --lr-min-ratio 0.1 --lr-decay-steps 50)
    for seed in $SEEDS; do
        run "loss-bf16-$seed" 300 "${L[@]}" --seed "$seed" "${BF16[@]}"
        run "loss-rowwise-$seed" 300 "${L[@]}" --seed "$seed" "${ROW[@]}"
        run "loss-tensorwise-$seed" 300 "${L[@]}" --seed "$seed" "${TENSOR[@]}"
    done
fi
