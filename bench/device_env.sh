#!/usr/bin/env bash
# Source on the GPU machine before a run: the wheels carried in .whl (the device has torch,
# transformers and peft, not the service's packages nor cffi), NVLink multicast kept off.
# Usage: source bench/device_env.sh   (the wheels: bash bench/fetch_wheels.sh, here, first)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "device_env: wheel install failed"
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
