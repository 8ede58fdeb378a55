"""QLoRA exports on CUDA: tests/unit/engine/adapters/test_qlora_export.py's scenario with the engine
on RP_DEVICES=cuda and transformers + peft on `device_map="cuda"`.

bitsandbytes quantizes the folder on the GPU there (the engine on the host, with its CPU
kernel), so the scenario's first check, the same NF4 codes on both sides, is also the
check that the two kernels agree. The engine runs its bf16 decoder compiled. fp32 runs
with TF32 off (the `cuda_devices` fixture) at atol 1e-5, the fp32 bar of
test_lora_gpu.py: cuBLAS may split the sums differently for the merged and the unmerged
GEMMs. The bf16 bar is the CPU test's (against the fp32 computation, at most twice
peft's own error plus 1e-3 of the logits' scale).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.unit.engine.adapters import test_qlora_export as cpu_tests

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

FP32_ATOL_CUDA = 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("kind", "tie"), [("qwen3", False), ("llama", True)])
def test_qlora_exports_load_in_peft_and_transformers_on_cuda(
    tmp_path: Path, kind: str, tie: bool, dtype: torch.dtype, cuda_devices: int
) -> None:
    cpu_tests.run_export_scenario(tmp_path, kind, tie, dtype, "cuda", fp32_atol=FP32_ATOL_CUDA)
