#!/usr/bin/env bash
# Device calls on nvidia-h200-x2 (session 27; logs to $OUT):
#   PART=tests    GPU 0: the CUDA-graph decode tests (issue 48) and the LoRA file beside,
#                 GPU 1: nothing else; then the 2-GPU tests (local ranks, multinode, NCCL)
#                 and `ONLY=shared bash bench/multinode.sh` (issue 47's 2 nodes >= 1.8x)
#   PART=scaling  issue 43: bench/train.py on 1 and on 2 GPUs at 262,144 tokens a step,
#                 then bench/profile_train.py's timeline of the 2-GPU step
#   PART=dp       issue 47: the multinode bench after session 27's reduction during the
#                 backward and gather-as-updated (1.24x before), rank 0's optimizer seconds
#   PART=overlap  issue 43: 1 and 2 GPUs with overlapped calls (the profile's 82 + 77 ms of
#                 fill and drain at the call boundary); first the 8B GRPO step with graphs
#                 (GPU 1, alone)
#   PART=service  issue 43: the daemon's 2-GPU job against bench/train.py on the same GPUs
#                 at staleness one (auto: one process, overlapped calls), then bench/train.py
#                 at staleness zero
#   PART=confirm  session 28's untested GPU test (test_local_ranks_gpu.py), then the daemon's
#                 2-GPU job against the bench again (another host)
#   source bench/device_env.sh && PART=tests OUT=$OUT bash bench/diag/call_two.sh
set -u
OUT=${OUT:-/tmp/calltwo}
mkdir -p "$OUT"
PYTEST=(python3 -m pytest -p no:cacheprovider -m gpu -v --tb=short)
case ${PART:-tests} in
tests)
    CUDA_VISIBLE_DEVICES=0 timeout 170 "${PYTEST[@]}" --timeout=120 \
        "tests/gpu/test_grpo_gpu.py::test_the_replayed_decode_step_gives_the_eager_samplers_rollouts_on_cuda" \
        "tests/gpu/test_grpo_gpu.py::test_compacted_rows_are_captured_again_on_cuda" \
        "tests/gpu/test_grpo_gpu.py::test_merged_adapters_give_the_engines_rollouts_on_cuda" \
        "tests/gpu/test_grpo_gpu.py::test_the_replayed_step_runs_a_half_precision_copy_on_cuda" \
        >"$OUT/grpo-graphs.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 timeout 170 "${PYTEST[@]}" --timeout=120 tests/gpu/test_lora_gpu.py \
        >"$OUT/lora.log" 2>&1 &
    wait
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/grpo-graphs.log" "$OUT/lora.log" | cut -c1-300 | tail -20
    timeout 200 "${PYTEST[@]}" --timeout=150 tests/gpu/test_local_ranks_gpu.py \
        tests/gpu/test_multinode_gpu.py "tests/gpu/test_distributed_gpu.py" >"$OUT/two.log" 2>&1
    grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/two.log" | cut -c1-300 | tail -12
    ONLY=shared STEPS=4 WARMUP=2 T_RUN=230 OUT=$OUT bash bench/multinode.sh
    ;;
scaling)
    ARGS=(--seqs-per-step 128 --num-microbatch 8 --warmup 3)
    RP_DEVICES=cuda:0 timeout 130 python3 bench/train.py "${ARGS[@]}" --steps 3 >"$OUT/one.jsonl" 2>"$OUT/one.err"
    RP_DEVICES=cuda:0,1 timeout 110 python3 bench/train.py "${ARGS[@]}" --steps 4 >"$OUT/two.jsonl" 2>"$OUT/two.err"
    for f in one two; do python3 bench/diag/train_summary.py "$OUT/$f.jsonl"
    tail -2 "$OUT/$f.err"; done
    RP_DEVICES=cuda:0,1 timeout 200 python3 bench/profile_train.py --seqs-per-step 128 \
        --num-microbatch 8 --steps 2 --warmup 3 --trace-dir /tmp/trace >"$OUT/profile2.jsonl" 2>"$OUT/profile2.err"
    cut -c1-3000 "$OUT/profile2.jsonl"; tail -3 "$OUT/profile2.err"
    ;;
dp)
    timeout 150 "${PYTEST[@]}" --timeout=120 tests/gpu/test_distributed_gpu.py >"$OUT/dp-tests.log" 2>&1
    grep -E "PASSED|FAILED|passed|failed" "$OUT/dp-tests.log" | tail -3
    ONLY=shared STEPS=3 WARMUP=2 T_RUN=400 OUT=$OUT bash bench/multinode.sh
    ;;
overlap)
    CUDA_VISIBLE_DEVICES=1 timeout 240 python3 bench/grpo.py --model qwen3-8b --runs engine \
        --steps 1 --warmup 1 >"$OUT/grpo-8b.jsonl" 2>"$OUT/grpo-8b.err"
    ARGS=(--seqs-per-step 128 --num-microbatch 8 --warmup 3 --overlap-calls)
    RP_DEVICES=cuda:0 timeout 130 python3 bench/train.py "${ARGS[@]}" --steps 3 >"$OUT/one-ov.jsonl" 2>"$OUT/one-ov.err"
    RP_DEVICES=cuda:0,1 timeout 110 python3 bench/train.py "${ARGS[@]}" --steps 4 >"$OUT/two-ov.jsonl" 2>"$OUT/two-ov.err"
    python3 bench/diag/train_summary.py "$OUT"/one-ov.jsonl "$OUT"/two-ov.jsonl
    cut -c1-900 "$OUT/grpo-8b.jsonl"; grep -h "grpo bench\|graph rollouts\|checked" "$OUT/grpo-8b.err" | tail -5
    ;;
service)
    # auto at staleness one: one process with overlapped calls (session 28's rule), and
    # bench/train.py as the job ran; then bench/train.py at staleness zero alone (the
    # service's staleness-zero job ran 74,183 tokens/s in session 28's call 3)
    timeout 330 python3 bench/service_train.py --gpus 2 --seqs-per-step 128 --num-microbatch 8 \
        --steps 4 --warmup 3 --step-staleness 1 >"$OUT/service-s1.jsonl" 2>"$OUT/service-s1.err"
    cut -c1-700 "$OUT/service-s1.jsonl"; grep -v "INFO:" "$OUT/service-s1.err" | tail -4 | cut -c1-300
    RP_DEVICES=cuda:0,1 timeout 130 python3 bench/train.py --seqs-per-step 128 --num-microbatch 8 \
        --warmup 3 --steps 4 --step-staleness 0 >"$OUT/bench-s0.jsonl" 2>"$OUT/bench-s0.err"
    python3 bench/diag/train_summary.py "$OUT/bench-s0.jsonl"; tail -3 "$OUT/bench-s0.err" | cut -c1-300
    ;;
confirm)
    # session 28's rewrite of the ranks/auto GPU test (auto: one process, overlapped calls,
    # the plain process's weights bit for bit), then the daemon's job on a second host
    timeout 260 "${PYTEST[@]}" --timeout=240 tests/gpu/test_local_ranks_gpu.py >"$OUT/ranks.log" 2>&1
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/ranks.log" | cut -c1-300 | tail -4
    timeout 330 python3 bench/service_train.py --gpus 2 --seqs-per-step 128 --num-microbatch 8 \
        --steps 4 --warmup 3 --step-staleness 1 >"$OUT/service-s1.jsonl" 2>"$OUT/service-s1.err"
    cut -c1-700 "$OUT/service-s1.jsonl"; grep -v "INFO:" "$OUT/service-s1.err" | tail -4 | cut -c1-300
    ;;
esac
