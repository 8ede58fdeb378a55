"""Rollouts through transformers' generate with a static cache (`compiled_decode`) against
the eager decode loop: on the CPU, where generate does not compile, the same rows token for
token (greedy and drawn, stops, LoRA), and a failure falls back to the eager loop."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from rp_service.worker import compiled_decode
from rp_service.worker.compiled_decode import compiled_decoding_wanted
from rp_service.worker.generation import RolloutSampler, make_sampler
from rp_service.worker.sampling import top_p_draw
from tests.unit.engine.conftest import use_devices
from tests.unit.rp_service.test_generation import GROUPS, _limits, _model, engine_group_rollouts


@pytest.fixture(autouse=True)
def cpu3() -> Iterator[int]:
    yield from use_devices("cpu:3", 3)


def _rollouts(sampler: RolloutSampler, *, sampled: bool, stop: set[int]) -> list[Any]:
    draw = (
        top_p_draw(temperature=1.2, top_p=0.9, generator=torch.Generator().manual_seed(4))
        if sampled
        else None
    )
    return sampler.complete(GROUPS, stop=stop, draw=draw, **_limits())


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("sampled", [False, True])
def test_generate_gives_the_eager_loops_rollouts(
    lora: bool, sampled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = compiled_decode.generate_rollouts

    def counted(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        real(*args, **kwargs)

    monkeypatch.setattr(compiled_decode, "generate_rollouts", counted)
    model = _model(lora)
    eager = RolloutSampler(model, torch.device("cpu"))
    # padded wider than the longest prompt, as a job pads every batch to its longest
    width = max(len(p) for p in GROUPS) + 3
    through_generate = RolloutSampler(model, torch.device("cpu"), compiled=True, prompt_width=width)
    free = _rollouts(eager, sampled=sampled, stop=set())
    stop = {free[2].ids[3]}  # ends row 2 early (and any row that draws it before)
    for stops in (set(), stop):
        want = _rollouts(eager, sampled=sampled, stop=stops)
        got = _rollouts(through_generate, sampled=sampled, stop=stops)
        assert through_generate.compiled  # it did not fall back
        assert got == want
    assert len(calls) == 2  # both went through generate
    # with the stop: rows ended early, so the chooser drew over fewer rows, and later draws
    # lined up only because both paths skip finished rows alike
    assert {s.finish_reason for s in want} == {"stop", "length"}


def test_a_wrapped_jobs_model_decodes_through_generate_as_the_engine_does() -> None:
    """A job's sampler copies the model after the engine wrapped it (the presets' layers,
    the adapters): generate must run the copy as the eager loop and the engine do."""
    from engine import wrap_model_to_roundpipe

    model = _model(True)
    want = engine_group_rollouts(wrap_model_to_roundpipe(model, optim_dtype=torch.float32))
    sampler = RolloutSampler(model, torch.device("cpu"), compiled=True)
    assert _rollouts(sampler, sampled=True, stop={7}) == want
    assert sampler.compiled


def test_compiled_on_the_cpu_it_compiles_once_and_gives_the_eager_rollouts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """generate compiles its step only on accelerators; its CompileConfig's
    `_compile_all_devices` makes it compile here too (inductor's CPU backend, no CUDA
    graphs): the decode step traces as one graph with the adapters, later batches (each a
    new static cache) compile nothing more, and the tokens are the eager loop's."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import CompileConfig

    def compiling(**options: Any) -> GenerationConfig:
        config = GenerationConfig(**options)
        if options.get("cache_implementation") == "static":
            config.compile_config = CompileConfig(fullgraph=True, mode="default")
            config.compile_config._compile_all_devices = True
        return config

    monkeypatch.setattr(compiled_decode, "GenerationConfig", compiling)
    model = _model(True)
    eager = RolloutSampler(model, torch.device("cpu"))
    sampler = RolloutSampler(model, torch.device("cpu"), compiled=True, prompt_width=8)
    stats = torch._dynamo.utils.counters["stats"]  # the process's: earlier tests' count
    before = stats["unique_graphs"]
    for sampled in (False, True, True):
        want = _rollouts(eager, sampled=sampled, stop={7})
        assert _rollouts(sampler, sampled=sampled, stop={7}) == want
        assert sampler.compiled
        assert stats["unique_graphs"] - before == 1  # fullgraph: one graph, compiled once


def test_the_checkpoints_generation_config_changes_no_score() -> None:
    """generate fills unset options from the model's generation config: a checkpoint's
    penalties would change the scores the eager loop draws from."""
    model = _model(False)
    model.generation_config.repetition_penalty = 3.0
    model.generation_config.no_repeat_ngram_size = 1
    want = _rollouts(RolloutSampler(model, torch.device("cpu")), sampled=False, stop=set())
    got = _rollouts(
        RolloutSampler(model, torch.device("cpu"), compiled=True), sampled=False, stop=set()
    )
    assert got == want
    assert any(len(set(s.ids)) < len(s.ids) for s in want)  # a repeat the penalty would stop
    assert model.generation_config.repetition_penalty == 3.0  # the job's model keeps its own


def test_a_failure_falls_back_to_the_eager_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(False)
    want = _rollouts(RolloutSampler(model, torch.device("cpu")), sampled=False, stop={7})

    def broken(*_: Any, **__: Any) -> None:
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(compiled_decode, "generate_rollouts", broken)
    sampler = RolloutSampler(model, torch.device("cpu"), compiled=True)
    assert _rollouts(sampler, sampled=False, stop={7}) == want
    assert not sampler.compiled  # and it stays eager


def test_compiled_decoding_is_opt_in_for_half_precision_gpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.delenv("RP_COMPILED_ROLLOUTS", raising=False)
    assert not compiled_decoding_wanted(cuda, torch.bfloat16)  # not measured yet: off
    monkeypatch.setenv("RP_COMPILED_ROLLOUTS", "1")
    assert compiled_decoding_wanted(cuda, torch.bfloat16)
    assert compiled_decoding_wanted(cuda, torch.float16)
    assert not compiled_decoding_wanted(cuda, torch.float32)
    assert not compiled_decoding_wanted(cpu, torch.bfloat16)
    monkeypatch.setenv("RP_COMPILED_ROLLOUTS", "force")
    tiny = _model(False)
    sampler = make_sampler(tiny, rows=4, tokens=32)
    assert sampler is not None and sampler.keep and sampler.compiled
