"""bench/fp8_layer.py's plumbing on the CPU (its figures need a GPU): one tiny layer, eager,
timed and profiled in bf16 and FP8, and the kernel categories of its GPU table."""

from __future__ import annotations

import pytest

from bench import fp8_layer


@pytest.mark.parametrize(
    ("kernel", "expected"),
    [
        ("triton_red_fused__to_copy_abs_amax_clamp_mul_0", "fused"),
        ("void cutlass::device_kernel<f8f8bf16_rowwise_kernel>", "gemm"),
        ("nvjet_qqtst_128x256_64x4_2x1_v_bz_coopB_TNT", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "gemm"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", "attention"),
        ("void at::native::elementwise_kernel<128, 4>", "other"),
    ],
)
def test_kernels_fall_into_their_categories(kernel: str, expected: str) -> None:
    assert fp8_layer.category(kernel) == expected


def test_the_tiny_layer_is_timed_and_profiled_in_each_precision() -> None:
    argv = "--tiny --device cpu --eager --iters 1 --warmup 0 --tokens 32 --seq-len 32 --top 4"
    rows = fp8_layer.main([*argv.split(), "--precisions", "bf16", "rowwise"])
    assert [(r["bench"], r["precision"]) for r in rows] == [
        ("fp8_layer", "bf16"),
        ("fp8_layer.kernels", "bf16"),
        ("fp8_layer", "rowwise"),
        ("fp8_layer.kernels", "rowwise"),
    ]
    for row in rows[0::2]:
        assert row["forward_ms"] > 0 and row["backward_ms"] > 0 and row["tokens"] == 32
    for table, fp8 in ((rows[1], False), (rows[3], True)):
        names = [k["kernel"] for k in table["top"]]
        assert len(names) == 4
        # the FP8 layer's backward runs its own autograd Function; the bf16 one does not
        assert any("Fp8Linear" in n for n in names) == fp8
        assert sum(table["category_ms"].values()) == pytest.approx(table["total_ms"], abs=0.01)
