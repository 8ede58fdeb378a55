#!/usr/bin/env bash
# The GPU suite on one GPU, in two device calls (it takes ~9.5 minutes in all, session 22):
# PART=a runs the files up to test_presets_gpu.py, PART=b the rest and then the GRPO file
# alone (the slowest file: ~4 minutes). Each pytest has a per-test timeout and a wall limit.
# Logs and JUnit files go to $OUT.
#   source bench/device_env.sh && PART=a OUT=$OUT bash bench/diag/call_one_gpu.sh
set -u
OUT=${OUT:-/tmp/calltests}
mkdir -p "$OUT"
PART=${PART:-a}
PYTEST=(python3 -m pytest -p no:cacheprovider -m gpu -v --tb=short --timeout=200)
mapfile -t FILES < <(ls tests/gpu/test_*_gpu.py | grep -v test_grpo_gpu.py)
if [[ $PART == a ]]; then
    mapfile -t FILES < <(printf '%s\n' "${FILES[@]}" | awk '$0 <= "tests/gpu/test_presets_gpu.py"')
else
    mapfile -t FILES < <(printf '%s\n' "${FILES[@]}" | awk '$0 > "tests/gpu/test_presets_gpu.py"')
fi
timeout 420 "${PYTEST[@]}" "${FILES[@]}" --junitxml="$OUT/suite-$PART.xml" >"$OUT/suite-$PART.log" 2>&1
if [[ $PART == b ]]; then
    # The resume test runs three CUDA workers: 130 s alone on an H200 (session 24), over
    # the 120 s it once had here, which read as a hang.
    timeout 360 "${PYTEST[@]}" --timeout=220 tests/gpu/test_grpo_gpu.py \
        --junitxml="$OUT/grpo.xml" >"$OUT/grpo.log" 2>&1
fi
for f in "$OUT"/suite-"$PART".log "$OUT"/grpo.log; do
    [[ -f $f ]] || continue
    echo "== $f"
    grep -E "^(FAILED|ERROR)" "$f" | head -20
    tail -2 "$f"
done
