"""Rollouts through transformers' `generate` with a static KV cache: a compiled decode step.

The resident sampler's own loop (`generation.RolloutSampler._decode`) decodes eagerly: each
token is one forward of the HF modules, ~85 kernels a decoder layer with the adapters
unmerged, launched one by one from Python. At GRPO's batch that is what a step waits on
(session 25, Qwen3-8B, 256 rows on an H200: 85 ms a token, where the weights' and the
cache's bytes take ~10-15 ms at the GPU's bandwidth). `generate` with
`cache_implementation="static"` compiles its one-token step on a GPU and replays it as CUDA
graphs (what chat serving does, `serving/process.py`).

What `generate` would do differently is kept out of the tokens:
- the choice: `generate` decodes greedily here, and `_Chooser`, the last logits processor,
  leaves one finite score a row: the token `draw` picks (the job's seeded host generator,
  one number a row) or the greedy one. It draws over the rows still active only, exactly
  as the eager loop does once finished rows have left its batch, so both consume the same
  numbers in the same order;
- the configuration: a generation config made here, and the copy's own made neutral
  (`generate` fills what a config leaves unset from the model's: a checkpoint's
  `repetition_penalty` or `no_repeat_ngram_size` would change the scores);
- the end of a row: `generate` keeps finished rows in the batch and pads them; their tokens
  after the stop are dropped here.

So on the CPU (where `generate` does not compile) the rollouts equal the eager loop's token
for token (tests/unit/rp_service/test_compiled_decode.py). On a GPU the compiled kernels
round the logits otherwise than eager ones, so a token near a tie may differ; the loss
never reads the sampler's numbers.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from transformers import GenerationConfig, LogitsProcessorList

from .sampling import Draw

if TYPE_CHECKING:
    from .generation import Decoding

__all__ = ["compiled_decoding_wanted", "generate_rollouts"]


def compiled_decoding_wanted(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a resident sampler on `device` of a `dtype` model decodes through
    `generate_rollouts`: with RP_COMPILED_ROLLOUTS=1, on a GPU, in half precision (opt-in
    until measured on a GPU; "force": anywhere, for tests)."""
    setting = os.environ.get("RP_COMPILED_ROLLOUTS", "0")
    if setting == "force":  # tests: the same path on the CPU, where generate runs eagerly
        return True
    return setting == "1" and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)


class _Chooser:
    """A logits processor that leaves each row one finite score: the chosen token.

    `rows` rows start active; a row whose last token (chosen at the call before) is a stop
    id is done from then on, and gets `pad_id` (which `generate` writes for it anyway)."""

    def __init__(self, draw: Draw | None, stop: set[int], pad_id: int, rows: int) -> None:
        self.draw = draw
        self.stop = sorted(stop)
        self.pad_id = pad_id
        self.done: Tensor | None = None
        self.rows = rows

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.done is None:
            self.done = torch.zeros(self.rows, dtype=torch.bool, device=scores.device)
        elif self.stop:
            stops = torch.tensor(self.stop, device=input_ids.device)
            self.done |= torch.isin(input_ids[:, -1], stops).to(self.done.device)
        active = (~self.done).nonzero().squeeze(1)
        logits = scores[active]
        chosen = logits.argmax(dim=-1) if self.draw is None else self.draw(logits.float())
        out = torch.full_like(scores, float("-inf"))
        out[active, chosen.to(active.device)] = 0.0
        out[self.done, self.pad_id] = 0.0
        return out


def generate_rollouts(
    model: Any,
    batch: Decoding,
    *,
    draw: Draw | None,
    max_new_tokens: int,
    stop: set[int],
    pad_id: int,
    width: int | None = None,
) -> None:
    """Decode `batch`'s rows with `model.generate` (static cache), filling its `made`,
    `stops` and `finish` as `RolloutSampler._decode` does. The prompts are left-padded to
    `width` where it is wider than the longest (one cache length, one compile, for every
    batch of a job). The caller makes sure no row reaches the model's positions within
    `max_new_tokens` (the eager loop's per-row limit)."""
    device = next(model.parameters()).device
    ids, mask = batch.left_padded(pad_id, width)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        use_cache=True,
        cache_implementation="static",
        eos_token_id=sorted(stop) or None,
        pad_token_id=pad_id,
    )
    # generate fills what `config` leaves unset from the model's own generation config (a
    # checkpoint's repetition_penalty, no_repeat_ngram_size...): the copy's is made neutral.
    # The copy is the sampler's own (a deep copy), so the job's model keeps its config.
    model.generation_config = GenerationConfig(pad_token_id=pad_id)
    chooser = _Chooser(draw, stop, pad_id, len(batch.rows))
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            generation_config=config,
            logits_processor=LogitsProcessorList([chooser]),
        )
    for i, new in zip(batch.rows, out[:, ids.shape[1] :].tolist(), strict=True):
        for token in new:
            if token in stop:
                batch.finish[i], batch.stops[i] = "stop", token
                break
            batch.made[i].append(token)
            if len(batch.made[i]) >= max_new_tokens:
                break
        if batch.finish[i] is None:
            batch.finish[i] = "length"
