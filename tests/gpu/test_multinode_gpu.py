"""Multi-node jobs' rank entry point on GPUs: `python -m rp_service.cluster.rank` under two
torchrun agents (c10d rendezvous, one GPU each, NCCL) trains the weights of one agent on
one GPU at the same global batch (bench/multinode.py, tiny-matrix 2-layer Qwen3, fp32)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bench.multinode import run_nodes

pytestmark = pytest.mark.gpu


def _first_traceback(out: Path) -> str:
    """An agent's first traceback (the rank's own error; torchrun's summary comes after)."""
    lines = out.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if "Traceback" in line), len(lines))
    return f"{out.name}:\n" + "\n".join(lines[start : start + 40])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_nccl_nodes_train_as_one(tmp_path: Path) -> None:
    def args(seqs_per_node: int) -> argparse.Namespace:
        return argparse.Namespace(
            model="tiny",
            gpu=True,
            seq_len=64,
            seqs_per_node=seqs_per_node,
            num_microbatch=2,
            steps=4,
            warmup=1,
            network=False,
            timeout_s=300.0,
        )

    one = run_nodes(args(8), 1, tmp_path, keep=True)  # the same global batch: 8 sequences
    two = run_nodes(args(4), 2, tmp_path, keep=True)
    logs = "\n".join(_first_traceback(out) for out in sorted(tmp_path.glob("nodes-*-agent-*.out")))
    assert one["exit_codes"] == [0] and two["exit_codes"] == [0, 0], logs
    w1 = load_file(str(Path(one["job_dir"]) / "output" / "model.safetensors"))
    w2 = load_file(str(Path(two["job_dir"]) / "output" / "model.safetensors"))
    assert sorted(w1) == sorted(w2)
    for name, tensor in w1.items():
        torch.testing.assert_close(w2[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
