#!/usr/bin/env bash
# One-GPU device calls for what session 25 left unmeasured (each ~9 minutes; logs to $OUT):
#   PART=grpo  issue 48: the full fine-tune's KL reference on CUDA (its GPU test), the 8B
#              engine step again (the reserved peak since the sampler hands
#              its KV cache back after the rollouts), then TRL and the engine on a smaller
#              batch that TRL finishes (8 prompts x 8 x 256 tokens): a whole ratio beside
#              the bound of the full batch, where TRL's step did not end in 530 s. Needs
#              `WITH_TRL=1 bash bench/fetch_wheels.sh`.
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
    timeout 120 python3 -m pytest -p no:cacheprovider -m gpu -v --tb=short --timeout=110 \
        "tests/gpu/test_grpo_gpu.py::test_a_full_fine_tunes_kl_reference_runs_on_cuda" \
        >"$OUT/grpo-full-kl.log" 2>&1
    tail -1 "$OUT/grpo-full-kl.log"
    timeout 250 python3 bench/grpo.py --model qwen3-8b --runs engine --steps 1 --warmup 1 \
        >"$OUT/grpo-8b.jsonl" 2>"$OUT/grpo-8b.err"
    timeout 300 python3 bench/grpo.py --model qwen3-8b --runs trl,engine --prompts 8 \
        --completion-len 256 --steps 1 --warmup 1 >"$OUT/grpo-small.jsonl" 2>"$OUT/grpo-small.err"
    cat "$OUT"/grpo-8b.jsonl "$OUT"/grpo-small.jsonl
    grep -h "grpo bench" "$OUT"/grpo-*.err | tail -12
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
