"""Completions with the weights a job is training: greedy (the sample prompts) or sampled
at a temperature and top-p, seeded (GRPO's rollouts).

Why the engine's own forward: a job's weights live in the engine (host memory, streamed
to the devices a layer group at a time), and the GPUs are full of the training's work.
Generating through `rp.forward`, as the evaluation does, needs no second copy of the
model on a GPU and reads exactly the weights the optimizer published (call it with the
weights synchronized, `rp.synchronize()`). The engine keeps no KV cache, so every new
token is one forward over the whole sequence so far: `sample_max_tokens` forwards per
evaluation, which the spec bounds (at most 8 prompts, 1024 tokens).

The prompts go through together, each row padded on the right: causal attention never
lets a token see the padding after it, so each row's next token is read at its own last
position. That read happens on the device (`output_fn`): the last hidden state of each
row times the output projection, then its argmax, so a forward brings back one id a row
instead of its logits. Rows leave the batch at an end-of-text token, at the token limit,
or when the sequence reaches the model's positions.

Sampling (`sampled_completions`) brings back each row's last-position logits instead and
draws from them with one random number a row taken from a `torch.Generator` on the host
that the caller seeds (`top_p_draw`): a resumed job that seeds the same generator draws the
same tokens. The whole batch (every prompt's group) goes through each forward.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..data.chat_template import generation_prompt
from ..data.tokenizer import IM_END, JobTokenizer

__all__ = [
    "Sample",
    "greedy_completions",
    "prompt_ids",
    "sample_event",
    "sample_message",
    "sampled_completions",
    "stop_ids",
    "top_p_draw",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class Sample:
    """One prompt's completion: its ids (the stop token left out) and why it ended."""

    ids: list[int]
    finish_reason: str  # "stop": an end-of-text token; "length": the token or position limit
    stop_id: int | None = None  # the end-of-text token that ended it ("stop")


def prompt_ids(tokenizer: JobTokenizer, prompts: Sequence[str], *, chat: bool) -> list[list[int]]:
    """Token ids of each prompt: a user turn in the tokenizer's chat template (with the
    assistant's turn opened) when `chat` and the tokenizer has a template, else the text."""
    hf = tokenizer.hf
    if chat and getattr(hf, "chat_template", None):
        texts = [generation_prompt(hf, [{"role": "user", "content": p}]) for p in prompts]
        # The template writes its special tokens itself: add none.
        return tokenizer.encode(texts)
    return tokenizer.encode(list(prompts))


def stop_ids(tokenizer: JobTokenizer, generation_config: Any = None) -> set[int]:
    """End-of-text ids: the tokenizer's, the model's generation config's, ChatML's turn end."""
    ids: set[int] = set()
    configured = getattr(generation_config, "eos_token_id", None)
    for value in (configured, tokenizer.eos_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    hf = tokenizer.hf
    if IM_END in (getattr(hf, "chat_template", None) or ""):
        end = hf.convert_tokens_to_ids(IM_END)
        if isinstance(end, int) and end != hf.unk_token_id:
            ids.add(end)
    return ids


Draw = Callable[[Tensor], Tensor]
"""Next ids (rows,) from the last-position logits (rows, vocab), fp32, on their device."""


def _next_ids(
    rp: Any, input_ids: Tensor, last: Tensor, *, num_microbatch: int, draw: Draw | None = None
) -> list[int]:
    """The next token of each row of `input_ids` (rows, seq), read at `last`: greedy (on
    the device), or `draw` from the logits brought back to the host."""
    from engine import RoundPipeRunConfig
    from engine.batch import even_counts, row_bounds, split_rows

    bounds = row_bounds(even_counts(input_ids.shape[0], num_microbatch))

    def pick(outputs: Any, micro_batch: int) -> Tensor:
        hidden, weight = outputs  # the head's (normed hidden (mb, seq, hidden), lm_head weight)
        a, b = bounds[micro_batch]
        at = last[a:b].to(hidden.device, non_blocking=True)
        picked = hidden[torch.arange(b - a, device=hidden.device), at]  # (mb, hidden)
        # lm_head is a bias-free Linear: the same product the full logits would hold
        logits = torch.nn.functional.linear(picked, weight)
        return logits.argmax(dim=-1) if draw is None else logits.float()

    config = RoundPipeRunConfig(
        num_microbatch=len(bounds),
        split_input=split_rows(bounds),
        merge_output=lambda parts: torch.cat([p.cpu() for p in parts]),
        output_fn=pick,
    )
    with torch.no_grad():
        out = rp.forward(input_ids=input_ids, return_logits=False, roundpipe_run_config=config)
    if draw is not None:
        out = draw(out)
    return [int(t) for t in out.tolist()]


def greedy_completions(rp: Any, prompts: Sequence[Sequence[int]], **limits: Any) -> list[Sample]:
    """Greedy continuations of the token-id `prompts` through the engine's forward;
    `limits` as `_complete`'s."""
    return _complete(rp, prompts, draw=None, **limits)


def top_p_draw(*, temperature: float, top_p: float, generator: torch.Generator) -> Draw:
    """A `Draw` sampling softmax(logits / temperature) cut to its top-p nucleus (the
    smallest set of most likely tokens whose mass reaches `top_p`; at least one).

    Inverse-CDF sampling: one uniform number a row from `generator` (a host generator, so
    the numbers depend on the seed alone), the rest where the logits are, in float64: the
    token whose share of the nucleus's cumulative mass first exceeds that number. A GPU
    sampler so draws in a few kernels a token; bringing (rows, vocab) logits to the host
    and drawing there (as `torch.multinomial` on the host did) took most of a decode step
    at GRPO's batch (256 rows x 152k tokens: 39M doubles a token). Devices round float64
    alike to within an ulp or two, so the same logits on a CPU and a GPU draw the same
    token unless the number falls within ~1e-15 of a boundary between two tokens' shares.
    """

    def draw(logits: Tensor) -> Tensor:
        u = torch.rand(logits.shape[0], 1, generator=generator, dtype=torch.float64)
        probs = torch.softmax(logits.double() / temperature, dim=-1)
        if top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the tokens ahead of each
            sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
            # back in vocabulary order: the cumulative mass below must not depend on how
            # two near-equal probabilities sorted (logits a rounding apart would swap them)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        cdf = probs.cumsum(dim=-1)
        # the first token whose cumulative mass exceeds u x (the kept mass): a zero-mass
        # token never does (its cumulative mass equals the one before it)
        target = u.to(cdf.device) * cdf[:, -1:]
        picked = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)
        return picked.squeeze(-1)

    return draw


def sampled_completions(
    rp: Any,
    prompts: Sequence[Sequence[int]],
    *,
    temperature: float,
    top_p: float,
    generator: torch.Generator,
    **limits: Any,
) -> list[Sample]:
    """Continuations of `prompts` drawn at `temperature` and `top_p` from `generator`;
    `limits` as `_complete`'s. Rows that share a prompt draw apart."""
    draw = top_p_draw(temperature=temperature, top_p=top_p, generator=generator)
    return _complete(rp, prompts, draw=draw, **limits)


def _complete(
    rp: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop: set[int],
    max_positions: int,
    pad_id: int,
    num_microbatch: int,
    draw: Draw | None,
) -> list[Sample]:
    """Continuations of `prompts`, each token chosen by `draw` (None: greedy).

    Args:
        max_new_tokens: Most tokens a completion gets.
        stop: Ids that end a completion (left out of it).
        max_positions: Longest sequence the model takes: a prompt this long or longer
            gets an empty completion.
        pad_id: Fills the rows shorter than the longest (never attended to).
        num_microbatch: Most micro-batches a forward is split into.
    """
    seqs = [list(p) for p in prompts]
    made: list[list[int]] = [[] for _ in seqs]
    stops: list[int | None] = [None for _ in seqs]
    finish: list[str | None] = [
        "length" if not s or len(s) >= max_positions or max_new_tokens < 1 else None for s in seqs
    ]
    # Every forward here has a new sequence length: a CUDA graph captured for each would
    # only take GPU memory and graph slots.
    with rp.replay_paused():
        while active := [i for i, f in enumerate(finish) if f is None]:
            width = max(len(seqs[i]) for i in active)
            input_ids = torch.full((len(active), width), pad_id, dtype=torch.long)
            for row, i in enumerate(active):
                input_ids[row, : len(seqs[i])] = torch.tensor(seqs[i], dtype=torch.long)
            last = torch.tensor([len(seqs[i]) - 1 for i in active], dtype=torch.long)
            chosen = _next_ids(rp, input_ids, last, num_microbatch=num_microbatch, draw=draw)
            for i, token in zip(active, chosen, strict=True):
                if token in stop:
                    finish[i], stops[i] = "stop", token
                    continue
                seqs[i].append(token)
                made[i].append(token)
                if len(made[i]) >= max_new_tokens or len(seqs[i]) >= max_positions:
                    finish[i] = "length"
    return [
        Sample(ids=m, finish_reason=f or "length", stop_id=e)
        for m, f, e in zip(made, finish, stops, strict=True)
    ]


def sample_event(
    rp: Any,
    hf_model: Any,
    *,
    step: int,
    prompts: Sequence[str],
    tokenizer: JobTokenizer,
    chat: bool,
    max_new_tokens: int,
) -> tuple[str, dict[str, Any]]:
    """The message and data of step `step`'s `sample` event: each prompt's completion by
    `rp`, the engine's wrap of `hf_model` (which gives the positions and end-of-text ids)."""
    start = time.perf_counter()
    positions = getattr(hf_model.config, "max_position_embeddings", None)
    samples = greedy_completions(
        rp,
        prompt_ids(tokenizer, prompts, chat=chat),
        max_new_tokens=max_new_tokens,
        stop=stop_ids(tokenizer, getattr(hf_model, "generation_config", None)),
        max_positions=positions or 1 << 30,
        pad_id=tokenizer.pad_id,
        num_microbatch=rp.num_microbatch,
    )
    seconds = time.perf_counter() - start
    tokens = sum(len(s.ids) for s in samples)
    data = {
        "step": step,
        "samples": [
            {
                "prompt": prompt,
                "completion": tokenizer.decode(s.ids),
                "tokens": len(s.ids),
                "finish_reason": s.finish_reason,
            }
            for prompt, s in zip(prompts, samples, strict=True)
        ],
        "tokens": tokens,
        "seconds": round(seconds, 3),
    }
    message = sample_message(step, len(samples), tokens)
    log.info("%s in %.1f s", message, seconds)
    return message, data


def sample_message(step: int, samples: int, tokens: int) -> str:
    """The event's line: ``step 5: 1 sample, 1 token`` (singular where one)."""

    def count(n: int, noun: str) -> str:
        return f"{n} {noun}" if n == 1 else f"{n} {noun}s"

    return f"step {step}: {count(samples, 'sample')}, {count(tokens, 'token')}"
