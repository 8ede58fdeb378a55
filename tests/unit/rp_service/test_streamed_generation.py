"""The streamed rollout sampler (`rp_service.worker.streamed_generation`): the decoder
layers uploaded from host memory at every forward, two at most on the device, give the
engine's uncached rollouts and the resident copy's token for token (greedy and sampled,
LoRA and full, an NF4 base uploaded packed); after an optimizer step it gives the
trainer's logits; placement picks it where the copy does not fit; a GRPO job takes it
with `grpo.generation: streamed`.

Three decoder layers, so a layer is dropped while a later one uploads (two layers would
never hold more than two); the CPU devices of CI (`cpu:3`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from engine import wrap_model_to_roundpipe
from engine.adapters.nf4 import quantize_base_nf4
from engine.memory import host_tensors
from rp_service.worker.generation import RolloutSampler, make_sampler, placement
from rp_service.worker.sampling import (
    Sample,
    greedy_completions,
    sampled_completions,
    top_p_draw,
)
from rp_service.worker.streamed_generation import (
    StreamedRolloutSampler,
    decoder_layers,
    packed_device_bytes,
    streamed_device_bytes,
)
from tests import tiny_models
from tests.unit.engine.adapters.test_nf4 import LLAMA_70B
from tests.unit.engine.conftest import use_devices
from tests.unit.rp_service.test_generation import (
    GROUPS,
    _limits,
    _sampler_logits,
    engine_rollouts,
    grpo_objective,
    sgd_step_logits,
)
from tests.unit.rp_service.test_sampling import POSITIONS, PROMPTS, VOCAB, with_lora

pytest.importorskip("transformers")

CPU = torch.device("cpu")
LAYERS = 3


@pytest.fixture(autouse=True)
def cpu3() -> Iterator[int]:
    yield from use_devices("cpu:3", 3)


def _model(*, lora: bool, nf4: bool = False) -> nn.Module:
    model = tiny_models.tiny_model(
        "qwen3",
        vocab_size=VOCAB,
        max_position_embeddings=POSITIONS,
        initializer_range=0.2,
        num_hidden_layers=LAYERS,
        **tiny_models.WIDE,
    ).eval()
    if nf4:
        quantize_base_nf4(model)
    return with_lora(model) if lora else model


def _draw(top_p: float = 0.9) -> object:
    return top_p_draw(temperature=1.3, top_p=top_p, generator=torch.Generator().manual_seed(11))


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_streamed_rollouts_equal_the_engines_and_the_copys(lora: bool, sampled: bool) -> None:
    model = _model(lora=lora)
    rp = wrap_model_to_roundpipe(model, optim_dtype=torch.float32)

    def engine(stop: set[int]) -> list[Sample]:
        if not sampled:
            return greedy_completions(rp, GROUPS, stop=stop, num_microbatch=3, **_limits())
        gen = torch.Generator().manual_seed(11)
        return sampled_completions(
            rp, GROUPS, stop=stop, num_microbatch=3, temperature=1.3, top_p=0.9, generator=gen,
            **_limits(),
        )  # fmt: skip

    stop = {engine(set())[2].ids[3]}  # ends that row early, maybe others
    want = engine(stop)
    for sampler in (StreamedRolloutSampler(model, CPU), RolloutSampler(model, CPU)):
        draw = _draw() if sampled else None
        assert sampler.complete(GROUPS, stop=stop, draw=draw, **_limits()) == want
    assert any(s.finish_reason == "stop" for s in want)  # rows left the batch early
    assert any(s.finish_reason == "length" for s in want)


def _nf4_lora_and_its_engine_rollouts() -> tuple[nn.Module, list[Sample]]:
    """A LoRA model over an NF4 base, and the engine's sampled rollouts of GROUPS (stop 7,
    `_draw`'s settings)."""
    model = _model(lora=True, nf4=True)
    rp = wrap_model_to_roundpipe(model, optim_dtype=torch.float32)
    gen = torch.Generator().manual_seed(11)
    want = sampled_completions(
        rp, GROUPS, stop={7}, num_microbatch=3, temperature=1.3, top_p=0.9, generator=gen,
        **_limits(),
    )  # fmt: skip
    return model, want


def _layers_host_bytes(model: nn.Module) -> int:
    """Bytes the decoder layers' weights take as the host holds them (NF4: packed), the
    adapters aside."""
    return sum(
        t.numel() * t.element_size()
        for layer in decoder_layers(model)
        for name, p in layer.named_parameters()
        if "lora_" not in name
        for t in host_tensors(p)
    )


def test_an_nf4_base_is_uploaded_packed_and_samples_as_the_engine_does() -> None:
    model, want = _nf4_lora_and_its_engine_rollouts()
    streamed = StreamedRolloutSampler(model, CPU)
    assert streamed.complete(GROUPS, stop={7}, draw=_draw(), **_limits()) == want
    assert RolloutSampler(model, CPU).complete(GROUPS, stop={7}, draw=_draw(), **_limits()) == want

    # One forward (the prefill alone) moves each layer's weights once, as the host holds
    # them: the packed codes and absmax, not the decoded values; the adapters stay.
    streamed.uploaded_bytes = 0
    streamed.complete(PROMPTS, stop=set(), draw=None, **_limits(max_new_tokens=1))
    packed = _layers_host_bytes(model)
    layers = decoder_layers(model)
    decoded = sum(p.numel() * p.element_size() for layer in layers for p in layer.parameters())
    assert streamed.uploaded_bytes == packed < decoded / 4


def test_packed_layers_upload_once_and_sample_as_the_engine_does() -> None:
    """Kept packed on the device (placement "packed"): the same rollouts as streaming and
    the engine, the layers' packed bytes moved once for all a step's forwards, and nothing
    kept after the step."""
    model, want = _nf4_lora_and_its_engine_rollouts()
    packed = StreamedRolloutSampler(model, CPU, packed_resident=True)
    assert packed.complete(GROUPS, stop={7}, draw=_draw(), **_limits()) == want
    moved = _layers_host_bytes(model)
    assert max(len(s.ids) for s in want) > 2  # several forwards, one upload
    assert packed.uploaded_bytes == moved
    assert packed.device_bytes == packed_device_bytes(model)
    packed.step_done()
    assert packed.model is None and not packed._resident
    packed.complete(PROMPTS, stop=set(), draw=None, **_limits(max_new_tokens=3))
    assert packed.uploaded_bytes == 2 * moved  # the next step uploads them again


def test_packed_layers_are_offered_only_for_a_frozen_nf4_base() -> None:
    nf4_lora = _model(lora=True, nf4=True)
    got = packed_device_bytes(nf4_lora)
    streamed = streamed_device_bytes(nf4_lora)
    assert got is not None and streamed is not None
    layers = decoder_layers(nf4_lora)
    decoded = sum(p.numel() * p.element_size() for layer in layers for p in layer.parameters())
    assert streamed < got < sum(p.numel() * p.element_size() for p in nf4_lora.parameters())
    # streaming's bytes plus the packed layers: about a quarter of decoded
    assert got - streamed == _layers_host_bytes(nf4_lora) < decoded / 3
    assert packed_device_bytes(_model(lora=True)) is None  # nothing packed: a copy is as small
    full = _model(lora=False, nf4=True)
    for p in full.parameters():
        p.requires_grad_(True)  # full fine-tuning: the optimizer changes the layers
    assert packed_device_bytes(full) is None


def test_make_sampler_keeps_the_layers_packed_where_placement_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rp_service.worker import generation

    asked: list[dict[str, object]] = []

    def packed_placement(**kwargs: object) -> str:
        asked.append(kwargs)
        return "packed"

    monkeypatch.setattr(generation, "placement", packed_placement)
    model = _model(lora=True, nf4=True)
    sampler = make_sampler(model, rows=8, tokens=POSITIONS)
    assert isinstance(sampler, StreamedRolloutSampler)
    assert sampler.packed_resident and not sampler.keep
    assert asked[0]["packed_bytes"] == packed_device_bytes(model) is not None


def test_at_most_two_layers_are_on_the_device_and_none_after_a_forward() -> None:
    model = _model(lora=True)
    sampler = StreamedRolloutSampler(model, CPU)
    held: list[int] = []
    fetch = sampler._fetch

    def counting(j: int) -> object:
        fetched = fetch(j)
        held.append(len(sampler._held))
        return fetched

    sampler._fetch = counting  # type: ignore[method-assign]
    sampler.complete(PROMPTS, stop=set(), draw=None, **_limits())
    forwards = _limits()["max_new_tokens"]
    assert len(held) == LAYERS * forwards and max(held) == 2
    assert sampler._held == {}
    skeleton = sampler.model
    assert skeleton is not None
    for layer in decoder_layers(skeleton):
        for name, p in layer.named_parameters():
            assert (p.device.type == "meta") == ("lora_" not in name), name
    assert all(p.device.type == "cpu" for p in skeleton.lm_head.parameters())
    sampler.step_done()  # not kept: the resident modules go too
    assert sampler.model is None and sampler._slots == []


def test_a_forward_that_raises_leaves_no_layer_behind() -> None:
    model = _model(lora=False)
    sampler = StreamedRolloutSampler(model, CPU)
    sampler.refresh()
    assert sampler.model is not None
    mlp = decoder_layers(sampler.model)[1].mlp

    def boom(*_: object) -> None:
        raise torch.OutOfMemoryError("simulated")

    handle = mlp.register_forward_pre_hook(boom)
    with pytest.raises(torch.OutOfMemoryError):
        sampler.complete(PROMPTS, stop=set(), draw=None, **_limits())
    assert sampler._held == {}
    assert all(p.device.type == "meta" for p in decoder_layers(sampler.model)[1].parameters())
    handle.remove()
    want = RolloutSampler(model, CPU).complete(PROMPTS, stop=set(), draw=None, **_limits())
    assert sampler.complete(PROMPTS, stop=set(), draw=None, **_limits()) == want


@pytest.mark.parametrize("lora", [False, True])
def test_after_a_step_the_streamed_sampler_gives_the_trainers_logits(lora: bool) -> None:
    """LoRA: the resident A and B are refreshed; full: the layers read the host weights
    at each upload, the resident head and embeddings are refreshed."""
    model = _model(lora=lora)
    rp = wrap_model_to_roundpipe(model, optim_dtype=torch.float32)
    sampler = StreamedRolloutSampler(model, CPU)
    sampler.refresh()
    after = sgd_step_logits(rp)
    sampler.refresh()
    torch.testing.assert_close(_sampler_logits(sampler, PROMPTS[0]), after, rtol=1e-5, atol=1e-5)
    # the resident trained weights only: LoRA's A and B; full: those outside the layers
    outside = 3  # embeddings, final norm, head (untied)
    assert len(sampler._trained) == (2 * 7 * LAYERS if lora else outside)


def test_every_family_streams_as_the_engine_samples() -> None:
    """Sliding windows and experts: HF's forward runs unchanged on the streamed layers."""
    for family in ("qwen2", "gpt_oss"):
        model = tiny_models.tiny_model(
            family,
            vocab_size=256,
            max_position_embeddings=POSITIONS,
            initializer_range=0.2,
            num_hidden_layers=LAYERS,
            **tiny_models.WIDE,
        ).eval()
        rp = wrap_model_to_roundpipe(model, optim_dtype=torch.float32)
        limits = _limits(max_new_tokens=12, stop={7, 91})
        gen = torch.Generator().manual_seed(3)
        want = sampled_completions(
            rp, GROUPS, num_microbatch=2, temperature=1.2, top_p=0.9, generator=gen, **limits
        )
        draw = top_p_draw(temperature=1.2, top_p=0.9, generator=torch.Generator().manual_seed(3))
        assert StreamedRolloutSampler(model, CPU).complete(GROUPS, draw=draw, **limits) == want


def _llama_70b_on_meta() -> nn.Module:
    """Llama-3-70B's shape in bf16, on the meta device (sizes only, no memory)."""
    import transformers

    sizes = {k: v for k, v in LLAMA_70B.items() if k != "model_type"}
    config = transformers.LlamaConfig(**sizes, tie_word_embeddings=False)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def test_placement_streams_what_does_not_fit_and_make_sampler_follows() -> None:
    gib = 1 << 30
    model = _llama_70b_on_meta()
    full = sum(p.numel() * 2 for p in model.parameters())
    streamed = streamed_device_bytes(model)
    assert streamed is not None
    layer = sum(p.numel() * 2 for p in decoder_layers(model)[0].parameters())
    rotary = sum(b.numel() * b.element_size() for b in model.buffers())
    outside = 2 * 128256 * 8192 * 2 + 8192 * 2 + rotary  # embeddings, head, final norm
    assert streamed == outside + 2 * layer
    assert 130 * gib < full and streamed < 8 * gib
    h200 = 140 * gib
    kv = 22 * gib
    args = {"kv_bytes": kv, "usable": h200, "held": 3 * gib, "streamed_bytes": streamed}
    assert placement(model_bytes=full, **args) == "streamed"
    assert placement(model_bytes=full, **{**args, "streamed_bytes": None}) == "none"
    assert placement(model_bytes=full, **{**args, "held": 115 * gib}) == "none"
    assert placement(model_bytes=16 * gib, **args) == "resident"
    assert placement(model_bytes=16 * gib, streamed_only=True, **args) == "streamed"
    # a frozen NF4 base: its packed layers (~35 GB for 70B) kept on the device if they fit
    packed = {**args, "packed_bytes": streamed + 33 * gib}
    assert placement(model_bytes=full, **packed) == "packed"
    assert placement(model_bytes=full, streamed_only=True, **packed) == "streamed"
    assert placement(model_bytes=full, **{**packed, "held": 90 * gib}) == "streamed"
    assert placement(model_bytes=16 * gib, **packed) == "resident"

    tiny = _model(lora=False)
    assert type(make_sampler(tiny, rows=64, tokens=POSITIONS)) is RolloutSampler
    forced = make_sampler(tiny, rows=64, tokens=POSITIONS, streamed_only=True)
    assert isinstance(forced, StreamedRolloutSampler) and not forced.keep
    headless = copy.deepcopy(tiny)
    headless.model.layers = nn.Sequential(*headless.model.layers)  # not the HF layout
    assert streamed_device_bytes(headless) is None
    assert make_sampler(headless, rows=64, tokens=POSITIONS, streamed_only=True) is None


@pytest.mark.parametrize("generation", ["streamed", "engine"])
def test_a_grpo_job_samples_as_its_generation_says(tmp_path: object, generation: str) -> None:
    objective, _, rp, spec = grpo_objective(tmp_path, generation=generation)
    if generation == "streamed":
        assert isinstance(objective.sampler, StreamedRolloutSampler)
    else:
        assert objective.sampler is None
    got = objective._complete(rp, GROUPS, step=2, max_new_tokens=6)
    assert got == engine_rollouts(objective, rp, spec, step=2, max_new_tokens=6)
    if objective.sampler is not None:
        assert objective.sampler.model is None  # dropped after the step's rollouts
    objective.close()
