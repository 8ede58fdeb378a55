"""GRPO jobs in the real worker on CUDA (RP_DEVICES=cuda): the CPU test's task
(tests/integration/test_worker_grpo.py) on a bfloat16 base with LoRA and the KL term, and
on an NF4 base (QLoRA), learns, and a kill -9 resumes bit for bit on the GPU too.

The grader asks for more than the CPU test's "contains a y": 0.4 for a "y" anywhere and 0.6
for a completion that is all "y" (the twelve the trained model writes). On the GPU the
untrained NF4 model's greedy answers copied the prompt's "y" into 12 of 16 rows (session
22: `valid_reward_initial` 0.75), so "contains a y" alone did not start low; no untrained
row writes twelve "y", so here the start is at most 0.4 whatever the kernels round.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.integration import test_worker as worker_tests
from tests.integration.test_worker_grpo import GRADER, make_job

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ALL_Y = {
    "type": "multi",
    "name": "y_all_through",
    "graders": {
        "has_y": GRADER,
        "all_y": {
            "type": "string_check",
            "name": "all_y",
            "input": "{{sample.output_text}}",
            "reference": "y" * 12,  # grpo.max_completion_tokens of the byte tokenizer's y
            "operation": "eq",
        },
    },
    "calculate_output": "0.4 * has_y + 0.6 * all_y",
}
SPEC = {
    "model.dtype": "bfloat16",
    "train.steps": 12,
    "train.method": "lora",
    "train.lr": 0.003,
    "train.checkpoint_interval": 4,
    "engine.gpus": 1,
    "grpo": {"group_size": 8, "max_completion_tokens": 12, "kl_coef": 0.02, "sample_interval": 0},
    "grader": ALL_Y,
}


def _run_on_cuda(job: Path, on_event: Any = None) -> tuple[int, list[dict[str, Any]]]:
    return worker_tests.run(job, on_event, devices="cuda")


@pytest.mark.parametrize("quantization", ["none", "nf4"])
def test_grpo_learns_on_cuda(tmp_path: Path, quantization: str) -> None:
    job = make_job(tmp_path / quantization, {**SPEC, "model.quantization": quantization})
    code, events = _run_on_cuda(job)
    assert code == 0, (job / "worker.log").read_text()[-3000:]
    steps = worker_tests.metrics(events)
    assert all(math.isfinite(m["kl"]) for m in steps)
    assert steps[0]["valid_reward_initial"] < 0.5
    assert steps[-1]["valid_reward_mean"] >= 0.9
    print(
        json.dumps([{k: m[k] for k in ("step", "step_seconds", "rollout_seconds")} for m in steps])
    )


def test_grpo_resumes_bit_for_bit_on_cuda(tmp_path: Path) -> None:
    straight = make_job(tmp_path / "straight", SPEC)
    assert _run_on_cuda(straight)[0] == 0
    job = make_job(tmp_path / "killed", SPEC)

    def kill(proc: subprocess.Popen[str], event: dict[str, Any]) -> None:
        if event["type"] == "metrics" and event["data"]["step"] == 6:
            proc.send_signal(signal.SIGKILL)

    assert _run_on_cuda(job, kill)[0] == -signal.SIGKILL
    assert _run_on_cuda(job)[0] == 0, (job / "worker.log").read_text()[-3000:]
    ours = load_file(str(job / "output" / "adapter_model.safetensors"))
    theirs = load_file(str(straight / "output" / "adapter_model.safetensors"))
    assert all(ours[k].equal(theirs[k]) for k in theirs)


@pytest.mark.parametrize("lora", [False, True])
def test_the_kv_cached_sampler_equals_the_engines_rollouts_on_cuda(lora: bool) -> None:
    """The sampler's copy on the GPU (fp32: the engine runs it eagerly there too) draws
    the engine's uncached rollouts token for token, and per-step placement gives the
    copy's memory back."""
    from engine import wrap_model_to_roundpipe
    from rp_service.worker.generation import RolloutSampler
    from rp_service.worker.sampling import sampled_completions, top_p_draw
    from tests.unit.engine.conftest import use_devices
    from tests.unit.rp_service.test_generation import GROUPS, _limits, _model

    for _ in use_devices("cuda", 1):
        model = _model(lora)
        rp = wrap_model_to_roundpipe(model, optim_dtype=torch.float32)
        want = sampled_completions(
            rp,
            GROUPS,
            stop={7},
            num_microbatch=3,
            temperature=1.2,
            top_p=0.9,
            generator=torch.Generator().manual_seed(4),
            **_limits(),
        )
        sampler = RolloutSampler(model, torch.device("cuda"), keep=False)
        draw = top_p_draw(temperature=1.2, top_p=0.9, generator=torch.Generator().manual_seed(4))
        assert sampler.complete(GROUPS, stop={7}, draw=draw, **_limits()) == want
        held = torch.cuda.memory_allocated()  # the copy, on the GPU
        sampler.step_done()
        assert sampler.model is None
        # the copy's bytes came back (cuBLAS workspaces of the first calls may stay)
        assert held - torch.cuda.memory_allocated() >= sampler.model_bytes
