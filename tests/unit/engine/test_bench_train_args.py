"""bench/train.py's argument checks: runs that could not work are refused before any model
is built, with the flag to change."""

from __future__ import annotations

import math

import pytest
import torch

from bench import train, train_args

LONG_8B = "--model qwen3-8b --seq-len 262144 --seqs-per-step 1 --num-microbatch 1"


def _parse(argv: str) -> object:
    return train.parse_args(argv.split())


@pytest.fixture
def cuda_torch_2_11(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA machine with the torch of the H100 where the SystemError was seen."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")


@pytest.mark.usefixtures("cuda_torch_2_11")
def test_memory_breakdown_with_a_chunked_mlp_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse(f"{LONG_8B} --memory-breakdown")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "pytorch/pytorch#179536" in err
    assert "--mlp-chunk-tokens 0" in err


@pytest.mark.usefixtures("cuda_torch_2_11")
@pytest.mark.parametrize(
    "argv",
    [
        f"{LONG_8B} --memory-breakdown --mlp-chunk-tokens 0",  # the MLP runs whole
        f"{LONG_8B}",  # no memory history
        "--memory-breakdown",  # 2048 x 16 tokens a micro-batch: under the threshold
        "--seq-len 131072 --seqs-per-step 1 --num-microbatch 1 --memory-breakdown",  # at it
        "--model qwen3-30b-a3b --seq-len 262144 --seqs-per-step 1 --num-microbatch 1 "
        "--memory-breakdown",  # experts never chunk
    ],
)
def test_memory_breakdown_is_kept_where_no_mlp_is_chunked(argv: str) -> None:
    assert _parse(argv) is not None


def test_memory_breakdown_is_kept_on_older_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "__version__", "2.10.0+cu128")
    assert _parse(f"{LONG_8B} --memory-breakdown").memory_breakdown


def test_one_sequence_a_step_needs_no_baseline_divisor() -> None:
    args = _parse("--seq-len 4096 --seqs-per-step 1 --num-microbatch 1")
    assert (args.seqs_per_step, args.num_microbatch) == (1, 1)


def test_lr_warmup_is_linear_then_flat() -> None:
    assert _parse("--lr 3e-4").lr_warmup_steps == 0
    assert _parse("--lr 3e-4 --lr-warmup-steps 20").lr_warmup_steps == 20
    assert [train_args.scheduled_lr(1.0, k, 4) for k in (1, 2, 4, 5, 200)] == [
        0.25,
        0.5,
        1.0,
        1.0,
        1.0,
    ]
    assert train_args.scheduled_lr(3e-4, 1, 0) == 3e-4  # no warm-up: the full lr at once


def test_unigram_entropy_of_the_batches() -> None:
    uniform = [torch.arange(4).repeat(8).view(4, 8)]
    assert abs(train.unigram_entropy(uniform) - math.log(4)) < 1e-12
    assert train.unigram_entropy([torch.full((2, 3), 7)]) == 0.0


def test_cosine_decay_after_the_warm_up_or_over_the_last_steps() -> None:
    lr = [train_args.scheduled_lr(1.0, k, 10, 200, 0.1) for k in (5, 10, 11, 105, 200)]
    assert lr[:2] == [0.5, 1.0] and 0.99 < lr[2] < 1.0
    assert abs(lr[3] - 0.55) < 1e-9 and abs(lr[4] - 0.1) < 1e-12  # half-way; the floor
    # decay over the last 50 steps: the peak holds until step 150
    late = [train_args.scheduled_lr(1.0, k, 10, 200, 0.1, 50) for k in (11, 150, 151, 175, 200)]
    assert late[:2] == [1.0, 1.0] and late[2] < 1.0
    assert abs(late[3] - 0.55) < 1e-9 and abs(late[4] - 0.1) < 1e-12
    assert train_args.scheduled_lr(1.0, 200, 10, 200) == 1.0  # min_ratio 1: constant


def test_fp8_runs_a_bfloat16_model_and_refuses_float16(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse("--matmul-precision fp8 --fp8-recipe tensorwise")
    assert (args.matmul_precision, args.fp8_recipe, args.dtype) == ("fp8", "tensorwise", "bfloat16")
    assert _parse("").dtype == "float16"  # the bf16 twin keeps the shapes' default
    with pytest.raises(SystemExit):
        _parse("--matmul-precision fp8 --dtype float16")
    assert "--dtype bfloat16" in capsys.readouterr().err
