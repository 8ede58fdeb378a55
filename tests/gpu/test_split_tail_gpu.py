"""The fused tail split over several jobs on CUDA: HF's loss, gradients and AdamW steps
(fp32, TF32 off); on one GPU all of the tail's jobs share the device and its replica."""

from __future__ import annotations

import copy

import pytest

from tests.unit.engine.test_split_tail import assert_same, hf_reference, tiny_qwen3, train

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("split", [2, 3])
def test_split_tail_trains_like_hf_on_cuda(cuda_devices: int, split: int) -> None:
    ref = tiny_qwen3()
    got = train(copy.deepcopy(ref), split, "stage", is_async=False)
    expected = hf_reference(ref)  # the fp32 HF model on the host
    assert_same(got, expected)
