"""The rollout sampler (`rp_service.worker.generation`): its KV-cached batched completions
equal the engine's uncached ones (`sampling`) token for token, greedy and sampled, for LoRA
and full fine-tuning; after an optimizer step its refreshed copy gives the trainer's
logits; and where its copy is placed.

The models are the sampling tests' tiny ones (wide initialisation: clear choices), on the
CPU device the engine runs on in CI (`cpu:3`, so the engine's side goes through three
micro-batches while the sampler decodes the whole batch at once).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from engine import RoundPipe, wrap_model_to_roundpipe
from engine.adapters.lora import lora_modules
from rp_service.data.tokenizer import load_tokenizer
from rp_service.schemas import JobSpec
from rp_service.worker.generation import (
    RolloutSampler,
    kv_cache_bytes,
    make_sampler,
    placement,
)
from rp_service.worker.objectives.grpo_job import GrpoObjective, step_generator
from rp_service.worker.sampling import (
    Sample,
    greedy_completions,
    sampled_completions,
    top_p_draw,
)
from rp_service.worker.training import JobPaths
from tests import tiny_models
from tests.unit.engine.conftest import use_devices
from tests.unit.rp_service.test_sampling import PAD, POSITIONS, PROMPTS, tiny, with_lora

pytest.importorskip("transformers")

GROUPS = [p for p in PROMPTS for _ in range(3)]  # each prompt 3 times, as a GRPO group


@pytest.fixture(autouse=True)
def cpu3() -> Iterator[int]:
    yield from use_devices("cpu:3", 3)


def _model(lora: bool) -> nn.Module:
    model = tiny("qwen3")
    return with_lora(model) if lora else model


def _limits(**extra: object) -> dict[str, object]:
    return {"max_new_tokens": 9, "max_positions": POSITIONS, "pad_id": PAD, **extra}


def engine_group_rollouts(rp: RoundPipe) -> list[Sample]:
    """The engine's rollouts of `GROUPS` as the sampler tests draw them (seed 4,
    temperature 1.2, top-p 0.9, stop id 7)."""
    return sampled_completions(
        rp,
        GROUPS,
        stop={7},
        num_microbatch=3,
        temperature=1.2,
        top_p=0.9,
        generator=torch.Generator().manual_seed(4),
        **_limits(),
    )


@pytest.mark.parametrize("lora", [False, True])
def test_greedy_rollouts_equal_the_engines_token_for_token(lora: bool) -> None:
    model = _model(lora)
    rp = wrap_model_to_roundpipe(model, optim_dtype=torch.float32)
    free = greedy_completions(rp, PROMPTS, stop=set(), num_microbatch=3, **_limits())
    stop = {free[2].ids[3]}  # a stop id that ends one row early and maybe others
    want = greedy_completions(rp, PROMPTS, stop=stop, num_microbatch=3, **_limits())
    sampler = RolloutSampler(model, torch.device("cpu"))
    got = sampler.complete(PROMPTS, stop=stop, draw=None, **_limits())
    assert got == want
    assert any(s.finish_reason == "stop" for s in got)
    assert any(s.finish_reason == "length" for s in got)


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampled_rollouts_equal_the_engines_token_for_token(lora: bool, top_p: float) -> None:
    model = _model(lora)
    rp = wrap_model_to_roundpipe(model, optim_dtype=torch.float32)
    stop = {7, 91}

    def gen() -> torch.Generator:
        return torch.Generator().manual_seed(11)

    want = sampled_completions(
        rp,
        GROUPS,
        stop=stop,
        num_microbatch=3,
        temperature=1.3,
        top_p=top_p,
        generator=gen(),
        **_limits(),
    )
    draw = top_p_draw(temperature=1.3, top_p=top_p, generator=gen())
    sampler = RolloutSampler(model, torch.device("cpu"))
    got = sampler.complete(GROUPS, stop=stop, draw=draw, **_limits())
    assert got == want
    assert len({tuple(s.ids) for s in got[:3]}) > 1  # one prompt's group draws apart


def test_prompts_at_the_position_limit_end_as_the_engines_do() -> None:
    model = tiny("qwen3")
    rp = wrap_model_to_roundpipe(model, optim_dtype=torch.float32)
    prompts = [list(range(1, 12)), [4, 5], [], [9, 9, 9]]
    limits = {"max_new_tokens": 40, "max_positions": 11, "pad_id": PAD, "stop": set()}
    want = greedy_completions(rp, prompts, num_microbatch=3, **limits)
    got = RolloutSampler(model, torch.device("cpu")).complete(prompts, draw=None, **limits)
    assert got == want
    assert got[0].ids == [] and got[2].ids == [] and len(got[1].ids) == 9


def _engine_logits(rp: object, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return rp.forward(input_ids=ids).logits[:, -1].float()  # type: ignore[attr-defined]


def sgd_step_logits(rp: RoundPipe) -> torch.Tensor:
    """The engine's last-position logits of `PROMPTS[0]` after one SGD step on it (the
    step checked to move them), the step synchronized."""
    prompt = torch.tensor([PROMPTS[0]] * 4)  # one row per micro-batch
    before = _engine_logits(rp, prompt)
    opt = torch.optim.SGD(rp.optim_parameters(), lr=0.5)
    ids = torch.tensor([PROMPTS[0] + [3, 4, 5]] * 4)
    rp.forward_backward(
        input_kwargs={"input_ids": ids, "labels": ids}, loss_fn=lambda out, _: out.loss
    )

    def step_fn() -> None:
        opt.step()
        opt.zero_grad()

    rp.step(step_fn)
    rp.synchronize()
    after = _engine_logits(rp, prompt)
    assert (after - before).abs().max() > 1e-2  # the step moved the model
    return after[0]


@pytest.mark.parametrize("lora", [False, True])
def test_after_a_step_the_sampler_gives_the_trainers_logits(lora: bool) -> None:
    model = _model(lora)
    rp = wrap_model_to_roundpipe(model, optim_dtype=torch.float32)
    sampler = RolloutSampler(model, torch.device("cpu"))
    sampler.refresh()
    copy_params = dict(sampler.model.named_parameters())  # type: ignore[union-attr]
    base_name = "model.layers.0.mlp.up_proj" + (".base_layer.weight" if lora else ".weight")
    base_before = copy_params[base_name]
    after = sgd_step_logits(rp)
    sampler.refresh()
    mine = _sampler_logits(sampler, PROMPTS[0])
    torch.testing.assert_close(mine, after, rtol=1e-5, atol=1e-5)
    # LoRA: the adapters were swapped in, the base copy stayed the tensor it was
    copy_now = dict(sampler.model.named_parameters())  # type: ignore[union-attr]
    assert copy_now[base_name] is base_before
    assert len(sampler._trained) == (4 * 7 if lora else len(copy_params))


def _sampler_logits(sampler: RolloutSampler, prompt: list[int]) -> torch.Tensor:
    seen: list[torch.Tensor] = []

    def draw(logits: torch.Tensor) -> torch.Tensor:
        seen.append(logits[0])
        return torch.tensor([PAD])

    sampler.complete([prompt], draw=draw, stop={PAD}, **_limits())
    return seen[0]


def test_the_copy_is_placed_by_its_size_against_the_devices_memory() -> None:
    gib = 1 << 30
    assert placement(model_bytes=16 * gib, kv_bytes=22 * gib, usable=140 * gib, held=0) == (
        "resident"
    )
    assert placement(model_bytes=16 * gib, kv_bytes=22 * gib, usable=70 * gib, held=0) == (
        "per_step"
    )
    assert placement(model_bytes=16 * gib, kv_bytes=22 * gib, usable=40 * gib, held=3 * gib) == (
        "none"
    )
    # Qwen3-8B's shape: 36 layers, 8 KV heads of 128, bf16: 144 KiB a token
    config = type(
        "C",
        (),
        {
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "hidden_size": 4096,
        },
    )()
    assert kv_cache_bytes(config, rows=1, tokens=1, dtype=torch.bfloat16) == 144 * 1024
    tiny_sampler = make_sampler(tiny("qwen3"), rows=64, tokens=POSITIONS)
    assert tiny_sampler is not None and tiny_sampler.keep


def test_a_per_step_copy_is_dropped_after_the_rollouts_and_uploaded_again() -> None:
    model = tiny("qwen3")
    sampler = RolloutSampler(model, torch.device("cpu"), keep=False)
    first = sampler.complete(PROMPTS, draw=None, stop=set(), **_limits())
    sampler.step_done()
    assert sampler.model is None
    assert sampler.complete(PROMPTS, draw=None, stop=set(), **_limits()) == first


def grpo_objective(
    tmp_path: object, **grpo: object
) -> tuple[GrpoObjective, nn.Module, RoundPipe, JobSpec]:
    """A GRPO job's objective on the demo's prompts and a byte-level tokenizer, prepared on
    a tiny model (returned with its engine wrap and the spec); `grpo` as the spec's."""
    spec = JobSpec.model_validate(
        {
            "model": {"preset": "qwen3"},
            "data": {"train": "synthetic", "seq_len": 64},
            "train": {"objective": "grpo"},
            "grpo": grpo,
            "grader": {
                "type": "string_check",
                "name": "y",
                "input": "{{sample.output_text}}",
                "reference": "y",
                "operation": "like",
            },
        }
    )
    root = Path(str(tmp_path))
    paths = JobPaths(
        train_path="synthetic",
        valid_path=None,
        model_path=None,
        tokenizer_path=None,
        output_dir=root / "out",
        checkpoint_dir=root / "ckpt",
    )
    tokenizer = load_tokenizer(None)  # byte-level: 260 ids, the pad among them
    objective = GrpoObjective(spec, paths, tokenizer, valid_source=None, emit=print)
    model = tiny_models.tiny_model(
        "qwen3", vocab_size=len(tokenizer.hf), max_position_embeddings=POSITIONS
    ).eval()
    rp = wrap_model_to_roundpipe(model, optim_dtype=torch.float32)
    objective.prepare(rp, model, lora=False, resuming=False)
    return objective, model, rp, spec


def engine_rollouts(
    objective: GrpoObjective, rp: RoundPipe, spec: JobSpec, *, step: int, max_new_tokens: int
) -> list[Sample]:
    """What the engine's path draws for `objective`'s step `step` on `GROUPS`."""
    return sampled_completions(
        rp,
        GROUPS,
        stop=objective.stop,
        max_new_tokens=max_new_tokens,
        max_positions=POSITIONS,
        pad_id=objective.tokenizer.pad_id,
        num_microbatch=rp.num_microbatch,
        temperature=1.0,
        top_p=1.0,
        generator=step_generator(spec.train.seed, step),
    )


def test_a_sampler_out_of_memory_falls_back_to_the_engine(tmp_path: object) -> None:
    """The job goes on: the rollouts of that step, and every later one, come from the
    engine's path with the step's own seeded draw."""
    objective, _, rp, spec = grpo_objective(tmp_path)
    assert objective.sampler is not None

    def out_of_memory(*_: object, **__: object) -> None:
        raise torch.OutOfMemoryError("simulated")

    objective.sampler.complete = out_of_memory  # type: ignore[method-assign]
    got = objective._complete(rp, GROUPS, step=3, max_new_tokens=5)
    assert objective.sampler is None
    assert got == engine_rollouts(objective, rp, spec, step=3, max_new_tokens=5)
    objective.close()


@pytest.mark.parametrize("family", [f for f in tiny_models.FAMILIES if f != "qwen3"])
def test_every_family_samples_as_the_engine_does(family: str) -> None:
    """Sliding windows (qwen2, mistral, gpt_oss) and experts (qwen3_moe, gpt_oss) too:
    the cache's layers follow the config, rows leave the batch and the cache alike."""
    model = tiny_models.tiny_model(
        family,
        vocab_size=256,
        max_position_embeddings=POSITIONS,
        initializer_range=0.2,
        **tiny_models.WIDE,
    ).eval()
    rp = wrap_model_to_roundpipe(model, optim_dtype=torch.float32)
    limits = _limits(max_new_tokens=12, stop={7, 91})
    want = sampled_completions(
        rp,
        GROUPS,
        num_microbatch=2,
        temperature=1.2,
        top_p=0.9,
        generator=torch.Generator().manual_seed(3),
        **limits,
    )
    draw = top_p_draw(temperature=1.2, top_p=0.9, generator=torch.Generator().manual_seed(3))
    assert RolloutSampler(model, torch.device("cpu")).complete(GROUPS, draw=draw, **limits) == want


def test_a_half_precision_models_adapters_are_copied_in_its_dtype() -> None:
    """LoRA's fp32 A and B of a bf16 model: kept bf16 in the copy (the forward casts them
    so at every call), refreshed from the fp32 host values; the logits are the model's."""
    model = with_lora(tiny("qwen3")).to(torch.bfloat16)
    for _, module in lora_modules(model):
        module.lora_A.float()
        module.lora_B.float()
    sampler = RolloutSampler(model, torch.device("cpu"))
    sampler.refresh()
    copied = dict(sampler.model.named_parameters())  # type: ignore[union-attr]
    a_name = "model.layers.0.self_attn.q_proj.lora_A.weight"
    assert copied[a_name].dtype == torch.bfloat16
    assert model.get_parameter(a_name).dtype == torch.float32
    with torch.no_grad():
        want = model(input_ids=torch.tensor([PROMPTS[0]])).logits[0, -1].float()
    torch.testing.assert_close(_sampler_logits(sampler, PROMPTS[0]), want, rtol=0.02, atol=0.02)
    with torch.no_grad():
        model.get_parameter(a_name).add_(1.0)
    sampler.refresh()
    assert torch.equal(copied[a_name], model.get_parameter(a_name).to(torch.bfloat16))


def test_a_resident_copy_stays_and_hands_back_the_kv_caches_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No GPU here: the sampler is never uploaded, only its device says "cuda".
    emptied: list[int] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    sampler = RolloutSampler(tiny("qwen3"), torch.device("cuda", 0), keep=True)
    copy = nn.Linear(1, 1)
    sampler.model = copy
    sampler.step_done()
    assert sampler.model is copy  # kept between steps
    assert emptied == [1]  # the rollouts' cache is not left reserved for training


@pytest.mark.parametrize("graphs", [False, True])
def test_adapters_merged_into_the_copy_give_the_engines_rollouts(graphs: bool) -> None:
    """RP_MERGED_ROLLOUTS=1: the copy carries W + s B A in its base weights, merged as the
    trainer's replicas merge them, and after an optimizer step the refreshed copy (the base
    uploaded again, the new adapters merged in) still draws the engine's rollouts."""
    import engine.optim as eo

    model = _model(True)
    rp = wrap_model_to_roundpipe(model, optim_dtype=torch.float32)
    sampler = RolloutSampler(model, torch.device("cpu"), graphs=graphs, merged=True)
    draw = top_p_draw(temperature=1.2, top_p=0.9, generator=torch.Generator().manual_seed(4))
    assert sampler.complete(GROUPS, stop={7}, draw=draw, **_limits()) == engine_group_rollouts(rp)
    assert sampler._merges and all(m.merged for _, m in sampler._merges)
    base = {n: p.clone() for n, p in model.named_parameters() if "base_layer" in n}

    opt = eo.Adam(list(rp.optim_parameters()), lr=0.05)
    ids = torch.tensor([p + [PAD] * (8 - len(p)) for p in GROUPS])
    from engine.models import causal_lm_loss_fn

    rp.forward_backward(
        input_kwargs={"input_ids": ids, "return_logits": False},
        label=ids,
        loss_fn=causal_lm_loss_fn(ids),
    )
    rp.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    rp.synchronize()
    sampler.refresh()
    draw = top_p_draw(temperature=1.2, top_p=0.9, generator=torch.Generator().manual_seed(4))
    got = sampler.complete(GROUPS, stop={7}, draw=draw, **_limits())
    assert got == engine_group_rollouts(rp)
    # the host's base weights stay as they were: the merge is the copy's alone
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)
