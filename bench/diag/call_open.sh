#!/usr/bin/env bash
# One-GPU device calls for what session 25 left unmeasured (each ~9 minutes; logs to $OUT):
#   PART=grpo  issue 48: the full fine-tune's KL reference on CUDA (its GPU test), then the
#              8B engine step with compiled decoding (RP_COMPILED_ROLLOUTS=1: generate's
#              static-cache step; the reserved peak too, now that the sampler hands its
#              cache back after the rollouts)
#   PART=trl   issue 48: TRL with its KV cache on (session 25's TRL run had it off):
#              beside the engine on a batch TRL finishes in a call (8 prompts x 8 x 256
#              tokens), then TRL's full 8B step alone. Needs `WITH_TRL=1 bash
#              bench/fetch_wheels.sh`.
#   PART=fp8   issue 49: the tensorwise reference test alone, its figures kept (session 25:
#              the file's time limit killed pytest before it printed them), then the
#              recipes on one 1.7B decoder layer.
#   PART=stale issue 44: the staleness pair with the deferred gradient copies against the
#              copies before them (`STAGES="clip copied" bash bench/staleness.sh`).
#   source bench/device_env.sh && PART=grpo OUT=$OUT bash bench/diag/call_open.sh
set -u
OUT=${OUT:-/tmp/callopen}
mkdir -p "$OUT"
case ${PART:-grpo} in
grpo)
    timeout 180 python3 -m pytest -p no:cacheprovider -m gpu -v --tb=short --timeout=110 \
        "tests/gpu/test_grpo_gpu.py::test_a_full_fine_tunes_kl_reference_runs_on_cuda" \
        "tests/gpu/test_grpo_gpu.py::test_compiled_decoding_gives_the_eager_samplers_rollouts_on_cuda" \
        >"$OUT/grpo-full-kl.log" 2>&1
    grep -E "PASSED|FAILED|ERROR" "$OUT/grpo-full-kl.log" | tail -4
    timeout 380 python3 bench/grpo.py --model qwen3-8b --runs engine --sampler compiled \
        --steps 1 --warmup 1 >"$OUT/grpo-8b-compiled.jsonl" 2>"$OUT/grpo-8b-compiled.err"
    cat "$OUT/grpo-8b-compiled.jsonl"
    grep -h "grpo bench\|compiled rollouts failed" "$OUT/grpo-8b-compiled.err" | tail -6
    ;;
trl)
    timeout 300 python3 bench/grpo.py --model qwen3-8b --runs trl,engine --prompts 8 \
        --completion-len 256 --steps 1 --warmup 1 >"$OUT/grpo-small.jsonl" 2>"$OUT/grpo-small.err"
    timeout 280 python3 bench/grpo.py --model qwen3-8b --runs trl --steps 1 --warmup 0 \
        >"$OUT/grpo-trl.jsonl" 2>"$OUT/grpo-trl.err"
    cat "$OUT"/grpo-small.jsonl "$OUT"/grpo-trl.jsonl
    grep -h "grpo bench" "$OUT"/grpo-small.err "$OUT"/grpo-trl.err | tail -12
    ;;
fp8)
    timeout 200 python3 -m pytest -p no:cacheprovider -m gpu -v --tb=long --timeout=150 \
        "tests/gpu/test_fp8_gpu.py::test_fp8_layers_equal_the_fp8_reference" \
        --junitxml="$OUT/fp8-ref.xml" >"$OUT/fp8-ref.log" 2>&1
    grep -E "PASSED|FAILED|from the FP8 reference|assert" "$OUT/fp8-ref.log" | head -20
    STAGES=layer timeout 330 bash bench/fp8.sh >"$OUT/fp8-layer.jsonl" 2>"$OUT/fp8-layer.err"
    cat "$OUT/fp8-layer.jsonl"
    ;;
stale)
    STAGES="clip copied" timeout 560 bash bench/staleness.sh >"$OUT/stale.jsonl" 2>"$OUT/stale.err"
    cat "$OUT/stale.jsonl"
    ;;
esac
