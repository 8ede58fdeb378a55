"""GRPO jobs in the real worker on CUDA (RP_DEVICES=cuda): the CPU test's task
(tests/integration/test_worker_grpo.py) on a bfloat16 base with LoRA and the KL term, and
on an NF4 base (QLoRA), learns, a kill -9 resumes bit for bit on the GPU too, and a full
fine-tune's KL reference runs beside it.

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


def test_a_full_fine_tunes_kl_reference_runs_on_cuda(tmp_path: Path) -> None:
    """The full fine-tune's reference (a second, frozen RoundPipe over the starting weights,
    session 25) beside the trained one on the GPU: KL ~0 at step 1, above 0 once the weights
    move (the CPU test's checks, tests/integration/test_worker_grpo.py)."""
    spec = {
        **SPEC,
        "train.method": "full",
        "train.steps": 4,
        "train.lr": 0.001,
        "train.checkpoint_interval": 0,
        "grpo": {**SPEC["grpo"], "kl_coef": 0.05},
    }
    job = make_job(tmp_path / "full", spec)
    code, events = _run_on_cuda(job)
    assert code == 0, (job / "worker.log").read_text()[-3000:]
    steps = worker_tests.metrics(events)
    assert abs(steps[0]["kl"]) < 1e-3  # bf16 kernels of two wraps: equal, or nearly
    assert all(m["kl"] > steps[0]["kl"] for m in steps[1:])


@pytest.mark.parametrize("lora", [False, True])
def test_the_kv_cached_sampler_equals_the_engines_rollouts_on_cuda(lora: bool) -> None:
    """The sampler's copy on the GPU (fp32: the engine runs it eagerly there too) draws
    the engine's uncached rollouts token for token, and per-step placement gives the
    copy's memory back."""
    from engine import wrap_model_to_roundpipe
    from rp_service.worker.generation import RolloutSampler
    from rp_service.worker.sampling import top_p_draw
    from tests.unit.engine.conftest import use_devices
    from tests.unit.rp_service.test_generation import GROUPS, _limits, _model, engine_group_rollouts

    for _ in use_devices("cuda", 1):
        model = _model(lora)
        rp = wrap_model_to_roundpipe(model, optim_dtype=torch.float32)
        want = engine_group_rollouts(rp)
        sampler = RolloutSampler(model, torch.device("cuda"), keep=False)
        draw = top_p_draw(temperature=1.2, top_p=0.9, generator=torch.Generator().manual_seed(4))
        assert sampler.complete(GROUPS, stop={7}, draw=draw, **_limits()) == want
        held = torch.cuda.memory_allocated()  # the copy, on the GPU
        sampler.step_done()
        assert sampler.model is None
        # the copy's bytes came back (cuBLAS workspaces of the first calls may stay)
        assert held - torch.cuda.memory_allocated() >= sampler.model_bytes


@pytest.mark.parametrize("sampled", [False, True])
def test_the_replayed_decode_step_gives_the_eager_samplers_rollouts_on_cuda(
    sampled: bool,
) -> None:
    """The resident copy's decode step captured as a CUDA graph and replayed
    (rp_service.worker.graph_decode) against the eager loop, fp32 with LoRA: the static
    cache's masked columns and the replay move the logits by fp32 roundings at most, far
    below these random logits' gaps, so the tokens agree (greedy, and drawn from float64
    shares of them); it does not fall back, and it replayed (the eager check passed)."""
    from rp_service.worker.generation import RolloutSampler
    from rp_service.worker.sampling import top_p_draw
    from tests.unit.engine.conftest import use_devices
    from tests.unit.rp_service.test_generation import GROUPS, _limits, _model

    def draw() -> Any:
        gen = torch.Generator().manual_seed(4)
        return top_p_draw(temperature=1.2, top_p=0.9, generator=gen) if sampled else None

    for _ in use_devices("cuda", 1):
        model = _model(True)
        eager = RolloutSampler(model, torch.device("cuda"))
        replayed = RolloutSampler(model, torch.device("cuda"), graphs=True)
        want = eager.complete(GROUPS, stop={7}, draw=draw(), **_limits())
        for _ in range(2):  # the second call replays the first call's graph
            assert replayed.complete(GROUPS, stop={7}, draw=draw(), **_limits()) == want
        decoder = replayed._decoder
        assert replayed.graphs and decoder is not None
        assert decoder.graph is not None and decoder.checked and decoder.replays > 8
        replayed.step_done()
        assert replayed._decoder is None


def test_compacted_rows_are_captured_again_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows ending early (stops that end most of them within four tokens) are compacted to
    the front and the step captured again for fewer rows: the eager sampler's tokens."""
    from rp_service.worker.generation import RolloutSampler
    from rp_service.worker.graph_decode import GraphDecoder
    from tests.unit.engine.conftest import use_devices
    from tests.unit.rp_service.test_generation import GROUPS, _limits, _model

    monkeypatch.setattr(GraphDecoder, "min_rows", 2)
    for _ in use_devices("cuda", 1):
        model = _model(True)
        eager = RolloutSampler(model, torch.device("cuda"))
        free = eager.complete(GROUPS, stop=set(), draw=None, **_limits())
        stop: set[int] = set()
        for row in free:
            if sum(bool(stop & set(r.ids[:4])) for r in free) >= 8:
                break
            stop.add(row.ids[2])
        want = eager.complete(GROUPS, stop=stop, draw=None, **_limits())
        replayed = RolloutSampler(model, torch.device("cuda"), graphs=True)
        assert replayed.complete(GROUPS, stop=stop, draw=None, **_limits()) == want
        decoder = replayed._decoder
        assert replayed.graphs and decoder.compactions >= 1 and decoder.graph is not None
        assert decoder.graph_rows == decoder.rows < len(GROUPS)
        replayed.step_done()
        counters = replayed.graph_counters
        # one capture a batch size: the first (unless rows ended at their first token, before
        # any step) and one after each compaction
        compactions = counters["compactions"]
        assert compactions <= counters["captures"] <= compactions + 1
        assert counters["capture_s"] > 0


def test_merged_adapters_give_the_engines_rollouts_on_cuda() -> None:
    """RP_MERGED_ROLLOUTS=1's copy (W + s B A merged as the trainer's replicas merge it),
    replayed: the engine's uncached rollouts token for token, fp32."""
    from engine import wrap_model_to_roundpipe
    from rp_service.worker.generation import RolloutSampler
    from rp_service.worker.sampling import top_p_draw
    from tests.unit.engine.conftest import use_devices
    from tests.unit.rp_service.test_generation import (
        GROUPS,
        _limits,
        _model,
        engine_group_rollouts,
    )

    for _ in use_devices("cuda", 1):
        model = _model(True)
        want = engine_group_rollouts(wrap_model_to_roundpipe(model, optim_dtype=torch.float32))
        sampler = RolloutSampler(model, torch.device("cuda"), graphs=True, merged=True)
        draw = top_p_draw(temperature=1.2, top_p=0.9, generator=torch.Generator().manual_seed(4))
        assert sampler.complete(GROUPS, stop={7}, draw=draw, **_limits()) == want
        assert sampler.graphs and sampler._merges


def test_the_replayed_step_runs_a_half_precision_copy_on_cuda() -> None:
    """bf16, as jobs run: the replay agrees with the eager step (the decoder's own check)
    and every row gets its tokens; the tokens themselves may part from the eager loop's at
    a near tie (bf16 roundings), so only their count is compared."""
    from rp_service.worker.generation import RolloutSampler
    from tests.unit.engine.conftest import use_devices
    from tests.unit.rp_service.test_generation import GROUPS, _limits, _model

    for _ in use_devices("cuda", 1):
        model = _model(True).to(torch.bfloat16)
        sampler = RolloutSampler(model, torch.device("cuda"), graphs=True)
        got = sampler.complete(GROUPS, stop=set(), draw=None, **_limits())
        assert sampler.graphs and sampler._decoder.checked
        assert [len(s.ids) for s in got] == [9] * len(GROUPS)


@pytest.mark.parametrize(
    ("lora", "nf4", "packed"),
    [(False, False, False), (True, False, False), (True, True, False), (True, True, True)],
)
def test_the_streamed_sampler_equals_the_engines_rollouts_on_cuda(
    lora: bool, nf4: bool, packed: bool
) -> None:
    """Three layers streamed to the GPU at every forward (a side stream, NF4 decoded
    there), or kept packed there and decoded at every forward (`packed`), draw the engine's
    uncached rollouts token for token."""
    from engine import wrap_model_to_roundpipe
    from rp_service.worker.sampling import top_p_draw
    from rp_service.worker.streamed_generation import StreamedRolloutSampler
    from tests.unit.engine.conftest import use_devices
    from tests.unit.rp_service.test_generation import GROUPS, _limits, engine_group_rollouts
    from tests.unit.rp_service.test_streamed_generation import _model

    for _ in use_devices("cuda", 1):
        model = _model(lora=lora, nf4=nf4)
        rp = wrap_model_to_roundpipe(model, optim_dtype=torch.float32)  # pinned host weights
        want = engine_group_rollouts(rp)
        sampler = StreamedRolloutSampler(model, torch.device("cuda"), packed_resident=packed)
        draw = top_p_draw(temperature=1.2, top_p=0.9, generator=torch.Generator().manual_seed(4))
        assert sampler.complete(GROUPS, stop={7}, draw=draw, **_limits()) == want
        sampler.step_done()
        assert sampler.model is None


@pytest.mark.parametrize("nf4", [False, True])
def test_the_streamed_sampler_holds_two_layers_not_the_model_on_cuda(nf4: bool) -> None:
    """Twelve 60 MB fp32 layers (or NF4-packed, decoded on the GPU): the peak the sampler
    adds on the GPU stays under the modules outside the layers, two layers, the KV cache
    and a margin (cuBLAS workspace, activations), far under the model; its rollouts are
    the resident copy's (a race between an upload and a layer's compute would not be)."""
    from engine import wrap_model_to_roundpipe
    from engine.adapters.nf4 import quantize_base_nf4
    from rp_service.worker.generation import RolloutSampler, kv_cache_bytes
    from rp_service.worker.streamed_generation import StreamedRolloutSampler
    from tests import tiny_models
    from tests.unit.engine.conftest import use_devices
    from tests.unit.rp_service.test_generation import _limits
    from tests.unit.rp_service.test_sampling import POSITIONS

    margin = 64 << 20
    for _ in use_devices("cuda", 1):
        model = tiny_models.tiny_model(
            "qwen3",
            vocab_size=1024,
            max_position_embeddings=POSITIONS,
            num_hidden_layers=12,
            hidden_size=1024,
            intermediate_size=4096,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=64,
            initializer_range=0.05,
        ).eval()
        if nf4:
            quantize_base_nf4(model)
        wrap_model_to_roundpipe(model, optim_dtype=torch.float32)  # pinned host weights
        rows = [[5 + r, 17, 33 + r, 2, 9][: 1 + r % 5] for r in range(24)]
        limits = _limits(max_new_tokens=16)
        cuda = torch.device("cuda")
        resident = RolloutSampler(model, cuda, keep=False)
        want = resident.complete(rows, stop=set(), draw=None, **limits)
        resident.step_done()

        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        sampler = StreamedRolloutSampler(model, cuda)
        assert sampler.complete(rows, stop=set(), draw=None, **limits) == want
        peak = torch.cuda.max_memory_allocated() - base
        kv = kv_cache_bytes(model.config, rows=len(rows), tokens=5 + 16, dtype=torch.float32)
        assert peak <= sampler.device_bytes + kv + margin, (peak, sampler.device_bytes, kv)
        assert peak < sampler.model_bytes / 2
        sampler.step_done()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() - base < margin  # the resident modules went
