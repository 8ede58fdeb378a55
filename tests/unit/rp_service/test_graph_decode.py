"""The decode step replayed as a CUDA graph (`graph_decode`), its static step run on the CPU
uncaptured (RP_GRAPH_ROLLOUTS=force): the eager loop's rollouts token for token (greedy and
drawn, stops, LoRA, prompts padded wider, the families it takes), the engine's for a wrapped
job's model, one decoder for a step's batches, and the eager loop wherever it cannot run.
The capture itself is tests/gpu/test_grpo_gpu.py's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from rp_service.worker import graph_decode
from rp_service.worker.generation import RolloutSampler, make_sampler
from rp_service.worker.graph_decode import (
    GraphDecoder,
    _prefill_mask,
    graph_decoding_wanted,
    unsupported_reason,
)
from rp_service.worker.sampling import top_p_draw
from tests.unit.engine.conftest import use_devices
from tests.unit.rp_service.test_generation import GROUPS, _limits, _model, engine_group_rollouts
from tests.unit.rp_service.test_sampling import tiny, with_lora

CPU = torch.device("cpu")


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


def _counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the batches GraphDecoder decodes."""
    calls: list[int] = []
    real = GraphDecoder.decode

    def decode(self: GraphDecoder, *args: Any, **kwargs: Any) -> None:
        calls.append(1)
        real(self, *args, **kwargs)

    monkeypatch.setattr(GraphDecoder, "decode", decode)
    return calls


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("sampled", [False, True])
def test_the_static_step_gives_the_eager_loops_rollouts(
    lora: bool, sampled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _counted(monkeypatch)
    model = _model(lora)
    eager = RolloutSampler(model, CPU)
    # padded wider than the longest prompt, as a job pads every batch to its longest
    width = max(len(p) for p in GROUPS) + 3
    static = RolloutSampler(model, CPU, graphs=True, prompt_width=width)
    free = _rollouts(eager, sampled=sampled, stop=set())
    stop = {free[2].ids[3]}  # ends row 2 early (and any row that draws it before)
    for stops in (set(), stop):
        want = _rollouts(eager, sampled=sampled, stop=stops)
        assert _rollouts(static, sampled=sampled, stop=stops) == want
        assert static.graphs  # it did not fall back
    assert len(calls) == 2
    # with the stop, rows ended early and the draws went over fewer rows: later draws lined
    # up only because both loops skip finished rows alike
    assert {s.finish_reason for s in want} == {"stop", "length"}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_other_families_decode_as_the_eager_loop(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _counted(monkeypatch)
    model = with_lora(tiny(family))
    if family == "qwen2":  # its tiny config slides on one layer: a full-attention twin
        model.config.layer_types = ["full_attention"] * model.config.num_hidden_layers
        model.config.use_sliding_window = False
    assert unsupported_reason(model) is None
    want = _rollouts(RolloutSampler(model, CPU), sampled=True, stop={7})
    static = RolloutSampler(model, CPU, graphs=True)
    assert _rollouts(static, sampled=True, stop={7}) == want
    assert static.graphs and calls == [1]


def test_a_wrapped_jobs_model_decodes_as_the_engine_does() -> None:
    """A job's sampler copies the model after the engine wrapped it (the presets' layers,
    the adapters): the static step must run that copy as the engine does."""
    from engine import wrap_model_to_roundpipe

    model = _model(True)
    want = engine_group_rollouts(wrap_model_to_roundpipe(model, optim_dtype=torch.float32))
    sampler = RolloutSampler(model, CPU, graphs=True)
    assert _rollouts(sampler, sampled=True, stop={7}) == want
    assert sampler.graphs


@pytest.mark.parametrize("sampled", [False, True])
def test_rows_compacted_as_they_end_decode_as_the_eager_loop(
    sampled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once at most half the rows still decode, the decoder moves them to the front and
    decodes those only (its cache's rows too): the same tokens, the draws over the same
    active rows."""
    monkeypatch.setattr(GraphDecoder, "min_rows", 2)
    model = _model(True)
    eager = RolloutSampler(model, CPU)
    free = _rollouts(eager, sampled=sampled, stop=set())
    stop: set[int] = set()
    for row in free:  # stops that end at least 8 of the 12 rows within their first tokens
        if sum(bool(stop & set(r.ids[:4])) for r in free) >= 8:
            break
        stop.add(row.ids[2])
    want = _rollouts(eager, sampled=sampled, stop=stop)
    ended = sum(s.finish_reason == "stop" and len(s.ids) < 6 for s in want)
    assert ended >= len(GROUPS) // 2  # enough rows end early for a compaction
    static = RolloutSampler(model, CPU, graphs=True)
    assert _rollouts(static, sampled=sampled, stop=stop) == want
    decoder = static._decoder
    assert static.graphs and decoder.compactions >= 1 and decoder.rows < len(GROUPS)
    # the next batch starts whole again
    assert _rollouts(static, sampled=sampled, stop=set()) == free
    assert static._decoder is decoder
    compactions = decoder.compactions
    static.step_done()  # the decoder goes, its counters stay
    assert static.graph_counters["compactions"] == compactions >= 1
    assert static.graph_counters["captures"] == 0  # uncaptured on the CPU


def test_one_decoder_serves_a_steps_batches_and_goes_at_its_end() -> None:
    sampler = RolloutSampler(_model(False), CPU, graphs=True, prompt_width=10)
    _rollouts(sampler, sampled=False, stop=set())
    decoder = sampler._decoder
    assert decoder is not None and decoder.width == 10
    _rollouts(sampler, sampled=True, stop=set())
    assert sampler._decoder is decoder  # the same shape: kept
    sampler.complete(GROUPS[:4], stop=set(), draw=None, **_limits())
    assert sampler._decoder is not decoder and sampler._decoder.rows == 4  # another shape
    sampler.step_done()
    assert sampler._decoder is None  # its cache goes back before training


def test_the_prefill_mask_is_causal_over_real_columns_and_never_empty() -> None:
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    allowed = _prefill_mask(mask)[:, 0]
    assert allowed.shape == (2, 4, 4)
    # row 0: padding queries (0, 1) see no real column to their left, so every column
    assert allowed[0, 0].all() and allowed[0, 1].all()
    assert allowed[0, 2].tolist() == [False, False, True, False]
    assert allowed[0, 3].tolist() == [False, False, True, True]
    assert torch.equal(allowed[1], torch.ones(4, 4, dtype=torch.bool).tril())


def test_a_failure_decodes_with_the_eager_loop_from_then_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _model(False)
    want = _rollouts(RolloutSampler(model, CPU), sampled=True, stop={7})

    def broken(self: GraphDecoder, batch: Any, **_: Any) -> None:
        batch.made[batch.rows[0]].append(3)  # half-done work the eager loop must not keep
        raise RuntimeError("capture failed")

    monkeypatch.setattr(GraphDecoder, "decode", broken)
    sampler = RolloutSampler(model, CPU, graphs=True)
    # the draw's generator is new for each call here, so the eager rollouts are the same
    assert _rollouts(sampler, sampled=True, stop={7}) == want
    assert not sampler.graphs and sampler._decoder is None


def test_an_attention_that_skips_the_cache_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill counts the cache's updates: attention that kept its own cache (or none)
    would decode from an empty one."""
    monkeypatch.setattr(graph_decode._StaticCache, "update", lambda self, k, v, *a, **kw: (k, v))
    model = _model(False)
    want = _rollouts(RolloutSampler(model, CPU), sampled=False, stop=set())
    sampler = RolloutSampler(model, CPU, graphs=True)
    assert _rollouts(sampler, sampled=False, stop=set()) == want
    assert not sampler.graphs


def test_rows_near_the_models_positions_decode_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The static step has no per-row position limit: a batch that could reach the model's
    positions within its token limit takes the eager loop (which ends those rows there)."""
    calls = _counted(monkeypatch)
    model = _model(False)
    limits = _limits(max_positions=12)
    want = RolloutSampler(model, CPU).complete(GROUPS, stop=set(), draw=None, **limits)
    sampler = RolloutSampler(model, CPU, graphs=True)
    assert sampler.complete(GROUPS, stop=set(), draw=None, **limits) == want
    assert calls == [] and sampler.graphs  # not a failure: this batch only
    assert any(len(s.ids) < 9 for s in want)


def test_where_graph_decoding_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda", 0)
    model = _model(False)
    monkeypatch.delenv("RP_GRAPH_ROLLOUTS", raising=False)
    assert graph_decoding_wanted(model, cuda)  # the default on a GPU
    assert not graph_decoding_wanted(model, CPU)
    monkeypatch.setenv("RP_GRAPH_ROLLOUTS", "0")
    assert not graph_decoding_wanted(model, cuda)
    monkeypatch.setenv("RP_GRAPH_ROLLOUTS", "force")
    assert graph_decoding_wanted(model, CPU)
    sampler = make_sampler(model, rows=4, tokens=32)
    assert sampler is not None and sampler.graphs

    eager_attention = _model(False)
    eager_attention.config._attn_implementation = "eager"
    assert "attention 'eager'" in (unsupported_reason(eager_attention) or "")
    assert not graph_decoding_wanted(eager_attention, cuda)
    assert "sliding" in (unsupported_reason(tiny("mistral")) or "")
    assert "sliding" in (unsupported_reason(tiny("qwen2")) or "")  # slides on one layer
    assert "qwen3_moe" in (unsupported_reason(tiny("qwen3_moe")) or "")
