#!/usr/bin/env bash
# The wheels the GPU machine lacks, into .whl (git-ignored; carry it: `carry: [".whl"]`, then
# `source bench/device_env.sh` there). The machine has torch, transformers, peft, httpx,
# jinja2, pyyaml, prometheus-client and sacrebleu; not the daemon's web stack, cffi (the C
# Adam), bitsandbytes (NF4) nor the graders' metrics. Versions: what this machine's
# `pip list` has, so both sides run the same code. ~51 MB (bitsandbytes is 43 of it) of the
# 64 MiB a call may carry; TRL for bench/grpo.py: WITH_TRL=1 (+~1 MB, pyarrow is there).
#   bash bench/fetch_wheels.sh
set -eu
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
mkdir -p .whl
version() { python3 -m pip show "$1" 2>/dev/null | awk '/^Version:/ {print $2}'; }
NAMES=(fastapi starlette opentelemetry-api pydantic pydantic-core pydantic-settings python-dotenv
    annotated-types typing-inspection uvicorn sse-starlette python-multipart cffi pycparser
    bitsandbytes rapidfuzz nltk)
[[ ${WITH_TRL:-0} == 1 ]] && NAMES+=(trl datasets dill multiprocess)
SPECS=()
for name in "${NAMES[@]}"; do
    v=$(version "$name")
    [[ -n $v ]] || { echo "fetch_wheels: $name is not installed here (pip install -e '.[dev]')"; exit 1; }
    SPECS+=("$name==$v")
done
PLATFORMS=()
for n in 17 24 27 28 31 34 35; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" --platform manylinux2014_x86_64 --platform any -d .whl "${SPECS[@]}"
# rouge-score ships only a source archive: built here into a pure-Python wheel.
python3 -m pip wheel -q --no-deps -w .whl "rouge-score==$(version rouge-score)"
du -sh .whl
