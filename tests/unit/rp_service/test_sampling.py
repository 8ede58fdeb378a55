"""Samples during training: greedy completions through the engine's forward, against
transformers' `generate` on the same weights (token for token), and the prompts' rendering.

The oracle runs each prompt alone with the KV cache; the engine runs all prompts together,
right-padded, one full forward a token. Every greedy choice of the oracle is checked to
lead its runner-up by a margin far above float32 rounding, so equality means the same
function, not a lucky tie.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from engine import wrap_model_to_roundpipe
from engine.adapters.lora import LoraConfig, apply_lora, lora_modules
from rp_service.data.tokenizer import CHAT_TEMPLATE, load_tokenizer
from rp_service.worker.sampling import (
    greedy_completions,
    prompt_ids,
    sample_event,
    sample_message,
    stop_ids,
)
from tests import tiny_models
from tests.unit.engine.conftest import use_devices

transformers = pytest.importorskip("transformers")

VOCAB, POSITIONS, PAD = 256, 64, 0
# Prompts of uneven lengths (7 and 1 tokens among them) over 3 micro-batches.
PROMPTS = [[5, 17, 33, 2, 9, 101, 44], [7], [200, 3, 3], [91, 12, 250, 60, 8]]
MARGIN = 1e-4  # the oracle's top logit leads the next by more than this at every choice


@pytest.fixture(autouse=True)
def cpu3() -> Iterator[int]:
    yield from use_devices("cpu:3", 3)


def tiny(family: str) -> nn.Module:
    # A wide initialisation spreads the logits, so greedy choices are clear.
    return tiny_models.tiny_model(
        family,
        vocab_size=VOCAB,
        max_position_embeddings=POSITIONS,
        initializer_range=0.2,
        **tiny_models.WIDE,
    ).eval()


def with_lora(model: nn.Module) -> nn.Module:
    apply_lora(model, LoraConfig(rank=4, alpha=8.0))
    torch.manual_seed(1)
    with torch.no_grad():  # B starts at zero: give the adapters something to say
        for _, module in lora_modules(model):
            module.lora_B.weight.normal_(std=0.2)
    return model


def oracle(model: nn.Module, prompt: list[int], *, max_new: int, stop: set[int]) -> list[int]:
    """transformers' greedy `generate`, the stop token left out; checks the margins."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=sorted(stop) or None,
        pad_token_id=PAD,
        output_scores=True,
        return_dict_in_generate=True,
        use_cache=True,
    )
    for scores in out.scores:
        top = scores[0].float().topk(2).values
        assert float(top[0] - top[1]) > MARGIN, "a near tie: choose another seed or init"
    made = out.sequences[0, len(prompt) :].tolist()
    return made[:-1] if made and made[-1] in stop else made


def engine_samples(model: nn.Module, **kwargs: object) -> list:
    rp = wrap_model_to_roundpipe(model, optim_dtype=torch.float32)
    return greedy_completions(rp, PROMPTS, pad_id=PAD, num_microbatch=3, **kwargs)


@pytest.mark.parametrize(
    ("family", "lora"), [("qwen3", False), ("llama", False), ("qwen3_moe", False), ("qwen3", True)]
)
def test_greedy_completions_match_transformers_generate(family: str, lora: bool) -> None:
    model = tiny(family)
    if lora:
        model = with_lora(model)
    plain = copy.deepcopy(model)
    got = engine_samples(model, max_new_tokens=9, stop=set(), max_positions=POSITIONS)
    for prompt, sample in zip(PROMPTS, got, strict=True):
        assert sample.ids == oracle(plain, prompt, max_new=9, stop=set())
        assert sample.finish_reason == "length" and len(sample.ids) == 9


def test_a_stop_token_ends_its_row_alone_and_is_left_out() -> None:
    model = tiny("qwen3")
    plain = copy.deepcopy(model)
    free = [oracle(plain, p, max_new=9, stop=set()) for p in PROMPTS]
    stop = {free[2][3]}  # the fourth token of the third prompt's free completion
    got = engine_samples(model, max_new_tokens=9, stop=stop, max_positions=POSITIONS)
    for prompt, sample in zip(PROMPTS, got, strict=True):
        want = oracle(plain, prompt, max_new=9, stop=stop)
        assert sample.ids == want
        assert sample.finish_reason == ("stop" if len(want) < 9 else "length")
    assert got[2].finish_reason == "stop" and len(got[2].ids) <= 3


def test_the_sequence_never_passes_the_models_positions() -> None:
    model = tiny("qwen3")
    plain = copy.deepcopy(model)
    limit = 10  # the 7-token prompt gets 3 tokens, the 1-token one 9
    got = engine_samples(model, max_new_tokens=40, stop=set(), max_positions=limit)
    for prompt, sample in zip(PROMPTS, got, strict=True):
        assert len(prompt) + len(sample.ids) == limit and sample.finish_reason == "length"
        assert sample.ids == oracle(plain, prompt, max_new=limit - len(prompt), stop=set())
    too_long = greedy_completions(
        wrap_model_to_roundpipe(tiny("qwen3"), optim_dtype=torch.float32),
        [list(range(1, 12)), [4, 5]],
        max_new_tokens=5,
        stop=set(),
        max_positions=11,
        pad_id=PAD,
        num_microbatch=3,
    )
    assert too_long[0].ids == [] and too_long[0].finish_reason == "length"
    assert len(too_long[1].ids) == 5


def test_prompts_use_the_chat_template_only_when_asked_and_present() -> None:
    tokenizer = load_tokenizer(None)  # the built-in byte-level one, ChatML template
    chat = prompt_ids(tokenizer, ["hi"], chat=True)[0]
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert chat == tokenizer.encode([text])[0]
    assert tokenizer.hf.chat_template == CHAT_TEMPLATE
    assert prompt_ids(tokenizer, ["hi"], chat=False) == [[ord("h"), ord("i")]]
    tokenizer.hf.chat_template = None
    assert prompt_ids(tokenizer, ["hi"], chat=True) == [[ord("h"), ord("i")]]


def test_stop_ids_are_end_of_text_and_chatml_turn_end() -> None:
    tokenizer = load_tokenizer(None)
    hf = tokenizer.hf
    expected = {hf.eos_token_id, hf.convert_tokens_to_ids("<|im_end|>")}
    assert stop_ids(tokenizer) == expected
    config = transformers.GenerationConfig(eos_token_id=[3, 4])
    assert stop_ids(tokenizer, config) == expected | {3, 4}


def test_the_event_decodes_each_completion_with_its_prompt() -> None:
    tokenizer = load_tokenizer(None)
    model = tiny_models.tiny_model("qwen3", vocab_size=264, initializer_range=0.2).eval()
    rp = wrap_model_to_roundpipe(model, optim_dtype=torch.float32)
    message, data = sample_event(
        rp,
        model,
        step=12,
        prompts=["a story", "b"],
        tokenizer=tokenizer,
        chat=False,
        max_new_tokens=4,
    )
    raw = greedy_completions(
        rp,
        prompt_ids(tokenizer, ["a story", "b"], chat=False),
        max_new_tokens=4,
        stop=stop_ids(tokenizer, model.generation_config),
        max_positions=64,
        pad_id=tokenizer.pad_id,
        num_microbatch=2,
    )
    assert data["step"] == 12 and message.startswith("step 12:")
    assert data["tokens"] == sum(len(s.ids) for s in raw) > 0
    assert [s["prompt"] for s in data["samples"]] == ["a story", "b"]
    for sample, ids in zip(data["samples"], raw, strict=True):
        assert sample["completion"] == tokenizer.decode(ids.ids)
        assert sample["tokens"] == len(ids.ids) and sample["finish_reason"] == ids.finish_reason


def test_evaluations_run_without_the_adapters_dropout() -> None:
    """A LoRA job's lora.dropout draws in training mode; its validation loss and samples run
    in eval mode (worker.evaluation.evaluating), the same at every call, and training
    resumes in training mode."""
    from rp_service.worker.evaluation import evaluating

    model = tiny("qwen3").train()
    apply_lora(model, LoraConfig(rank=4, alpha=8.0, dropout=0.5))
    with torch.no_grad():
        for _, module in lora_modules(model):
            module.lora_B.weight.normal_(std=0.2)
    rp = wrap_model_to_roundpipe(model)
    ids = torch.tensor(PROMPTS[0] * 2).view(2, 7).repeat(3, 1)
    with torch.no_grad():
        drawn = [rp(ids).logits for _ in range(2)]  # dropout on: two draws
        assert not torch.equal(drawn[0], drawn[1])
        with evaluating(rp):
            assert not rp.training
            clean = [rp(ids).logits for _ in range(2)]
        assert rp.training
        again = rp(ids).logits
    torch.testing.assert_close(clean[0], clean[1], rtol=0, atol=0)
    assert not torch.equal(again, clean[0])


def test_the_event_line_counts_in_the_singular_where_one() -> None:
    assert sample_message(5, 1, 1) == "step 5: 1 sample, 1 token"
    assert sample_message(50, 2, 97) == "step 50: 2 samples, 97 tokens"
    assert sample_message(7, 1, 0) == "step 7: 1 sample, 0 tokens"


def test_top_p_draws_only_from_the_nucleus_and_repeats_with_its_seed() -> None:
    from rp_service.worker.sampling import top_p_draw

    # probabilities 0.5, 0.3, 0.15, 0.05: a top-p of 0.7 keeps the first two only
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(2000, 1)
    draw = top_p_draw(temperature=1.0, top_p=0.7, generator=torch.Generator().manual_seed(3))
    ids = draw(logits)
    counts = torch.bincount(ids, minlength=4).tolist()
    assert counts[2] == counts[3] == 0 and counts[0] > counts[1] > 0
    assert abs(counts[0] / 2000 - 0.5 / 0.8) < 0.05  # renormalised over the nucleus
    again = top_p_draw(temperature=1.0, top_p=0.7, generator=torch.Generator().manual_seed(3))
    assert torch.equal(again(logits), ids)
    # a low temperature sharpens towards the top token; top_p 1 keeps every token
    cold = top_p_draw(temperature=0.05, top_p=1.0, generator=torch.Generator().manual_seed(0))
    assert (cold(logits) == 0).float().mean() > 0.99


def test_sampled_completions_are_seeded_and_rows_of_one_prompt_differ() -> None:
    from rp_service.worker.sampling import sampled_completions

    rp = wrap_model_to_roundpipe(tiny("qwen3"), optim_dtype=torch.float32)

    def sample(seed: int) -> list[list[int]]:
        out = sampled_completions(
            rp,
            [PROMPTS[0]] * 4,
            max_new_tokens=4,
            stop=set(),
            max_positions=POSITIONS,
            pad_id=PAD,
            num_microbatch=2,
            temperature=1.5,
            top_p=1.0,
            generator=torch.Generator().manual_seed(seed),
        )
        assert all(s.finish_reason == "length" and s.stop_id is None for s in out)
        return [s.ids for s in out]

    first = sample(5)
    assert sample(5) == first
    assert len({tuple(ids) for ids in first}) > 1  # one prompt, different completions
    assert sample(6) != first
