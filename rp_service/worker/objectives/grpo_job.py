"""A GRPO job's side of the training loop: its prompts, rollouts, rewards and step.

Each batch of rollouts (`_make_rollouts`), with the weights the previous update published
(the loop synchronizes first, `needs_sync_before_step`):

1. rollouts: the batch's `train.batch_size` prompts, each `grpo.group_size` times, sampled
   together (temperature, top-p) from a generator seeded by (train.seed, step): a resumed
   attempt draws what the uninterrupted one drew. Where the model fits on the first GPU
   they are decoded with a KV cache on a copy of the model there (`generation`, the
   adapters or weights refreshed each batch); else, or with `grpo.generation: streamed`,
   with a KV cache there and the decoder layers streamed from host memory at every token
   (`streamed_generation`); where neither fits, or with `grpo.generation: engine`,
   through the engine's forward, one full forward a token (`sampling`);
2. rewards: the grader scores every completion against its prompt's row (one `grade`
   call a batch); a grader error scores 0 and is counted (`grader_errors`);
3. with `grpo.num_iterations` > 1, the rollout policy's log-probabilities (one forward
   without gradients), the denominator of the ratio in every step on this batch.

Each step then takes the loss (`grpo.grpo_loss_fn`) on the completion tokens (the
end-of-text token that closed a completion included, so stopping is learned), with the k3
KL to a reference when `grpo.kl_coef` > 0: a LoRA job's base with the adapters off; a
full fine-tune's starting weights, built again from the spec, frozen and wrapped for
forwards only (a second copy of the model in host memory, which the memory plan counts).
A batch of rollouts serves `num_iterations` consecutive steps (the loop's
`BatchOrder` repeats its prompts as many times). Where a step's time goes is in its
metrics: `rollout_seconds`, `grading_seconds` (0 on the steps that reuse a batch), the rest
being the training forward and backward.

The prompt order is the loop's `BatchOrder` (a function of the seed and the step). A
checkpoint taken inside a batch's steps keeps that batch (completions, scores, and the
rollout policy's and the reference's log-probabilities: the weights that made them are
gone) in `state_dict`; otherwise the state is empty.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...data.formats import DataFormatError, iter_records
from ...data.prompts import PromptRows, build_prompts, synthetic_prompts
from ...demo import SYNTHETIC
from ...errors import JobFailure
from ...graders import (
    GraderConfigError,
    GradeResult,
    Sample,
    build_grader,
    python_graders_allowed,
)
from ..evaluation import evaluating
from ..generation import RolloutSampler, make_sampler
from ..sampling import Sample as Completion
from ..sampling import greedy_completions, sampled_completions, stop_ids, top_p_draw
from . import grpo

if TYPE_CHECKING:
    from ...data.tokenizer import JobTokenizer
    from ...graders import Grader
    from ...schemas import GrpoSection, JobSpec
    from ..meter import Emit
    from ..training import JobPaths

__all__ = ["MAX_SAMPLE_ROWS", "GrpoObjective", "step_generator", "train_on_rollouts"]

log = logging.getLogger(__name__)

MAX_SAMPLE_ROWS = 8  # rollouts shown in a `sample` event
SYNTHETIC_TRAIN_PROMPTS, SYNTHETIC_VALID_PROMPTS = 256, 16  # the demo's generated rows
_SEED_STRIDE = 1_000_003  # a prime: (seed, step) pairs map to distinct generator seeds
# On GPUs the training batch's width is rounded up to a multiple of this (right padding,
# which no loss token sees): there the half-precision decoder layers are compiled for fixed
# shapes (engine.models._compile), and a width that changed every step would compile them
# again every step. CPU devices run eagerly: no padding, no extra work.
WIDTH_MULTIPLE = 64


def step_generator(seed: int, step: int) -> torch.Generator:
    """The sampler's generator of step `step`: a function of the seed and the step only."""
    return torch.Generator().manual_seed((seed * _SEED_STRIDE + step) % (1 << 63))


def _load_prompts(source: str, param: str, spec: JobSpec, tokenizer: JobTokenizer) -> PromptRows:
    try:
        if source == SYNTHETIC:  # the demo's generated rows
            count = SYNTHETIC_VALID_PROMPTS if param == "data.valid" else SYNTHETIC_TRAIN_PROMPTS
            rows = synthetic_prompts(count, seed=0, valid=param == "data.valid")
            return build_prompts(enumerate(rows, start=1), tokenizer, max_tokens=spec.data.seq_len)
        if not Path(source).is_file():
            raise JobFailure("invalid_data", f"{param}: file {source!r} not found", param=param)
        records = []
        for line, line_format, record in iter_records(source, spec.data.format):
            if line_format != "prompt":
                raise DataFormatError(
                    f'train.objective grpo needs prompt rows ({{"messages": [...]}} without '
                    f'an assistant turn, or {{"prompt": ...}}), this file holds {line_format} '
                    "records",
                    line=line,
                )
            records.append((line, record))
        return build_prompts(records, tokenizer, max_tokens=spec.data.seq_len)
    except DataFormatError as exc:
        raise exc.in_field(param) from exc


def _sample(text: str) -> Sample:
    """A completion as graders read it: its text, and the object when it is JSON."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        value = None
    return Sample(output_text=text, output_json=value if isinstance(value, dict) else None)


@dataclass(kw_only=True, slots=True)
class _Rollouts:
    """One batch of rollouts and what every step that trains on it reads."""

    step: int  # the step that made them
    rows: list[int]  # the prompt of each completion, group by group
    completions: list[Completion]
    graded: GradeResult
    ids: torch.Tensor  # input ids (rows, width), right-padded
    targets: torch.Tensor  # the completion tokens, -100 elsewhere
    old: torch.Tensor | None  # the rollout policy's log-probabilities (num_iterations > 1)
    ref: torch.Tensor | None  # the reference's (kl_coef > 0)
    rollout_s: float = 0.0
    grading_s: float = 0.0


class GrpoObjective:
    """Prompts, grader, rollouts and loss of one attempt of a GRPO job (an `Objective`)."""

    data_format = "prompt"
    needs_sync_before_step = True

    def __init__(
        self,
        spec: JobSpec,
        paths: JobPaths,
        tokenizer: JobTokenizer,
        *,
        valid_source: str | None,
        emit: Emit,
        build_reference: Callable[[], Any] | None = None,
    ) -> None:
        """`build_reference`: a full fine-tune's KL reference, a frozen RoundPipe over the
        starting weights (called in `prepare` when `grpo.kl_coef` > 0 without LoRA)."""
        assert spec.grpo is not None and spec.grader is not None  # JobSpec's rules
        self.options = spec.grpo
        self.seed = spec.train.seed
        self.batch_size = spec.train.batch_size
        self.steps_per_batch = spec.grpo.num_iterations
        self.emit = emit
        self.tokenizer = tokenizer
        self.train = _load_prompts(paths.train_path, "data.train", spec, tokenizer)
        self.valid = (
            _load_prompts(valid_source, "data.valid", spec, tokenizer) if valid_source else None
        )
        try:
            self.grader: Grader = build_grader(
                spec.grader,
                allow_python=python_graders_allowed(),
                workdir=paths.checkpoint_dir.parent / "grader",
            )
        except GraderConfigError as exc:
            raise JobFailure("invalid_grader", str(exc), param=exc.field) from None
        self.lora = False
        self.width_multiple = 1
        self.max_positions = 1 << 30
        self.stop: set[int] = set()
        self._values: list[torch.Tensor] | None = None
        self._metrics: dict[str, Any] = {}
        self._initial: float | None = None
        self.sampler: RolloutSampler | None = None
        self.build_reference = build_reference
        self.reference: Any = None  # a full fine-tune's frozen RoundPipe (kl_coef > 0)
        self._batch: _Rollouts | None = None
        self._step = 0  # the last step trained

    # -- setup

    def prepare(self, rp: Any, hf_model: Any, *, lora: bool, resuming: bool) -> None:
        from engine.device import get_devices

        self.lora = lora
        self.width_multiple = WIDTH_MULTIPLE if any(d.is_cuda for d in get_devices()) else 1
        positions = getattr(hf_model.config, "max_position_embeddings", None)
        self.max_positions = positions or self.max_positions
        self.stop = stop_ids(self.tokenizer, getattr(hf_model, "generation_config", None))
        if self.options.kl_coef > 0 and not lora:
            if self.build_reference is None:
                raise ValueError("a full fine-tune's KL term needs build_reference")
            self.reference = self.build_reference()
        if self.options.generation != "engine":
            self.sampler = self._make_sampler(hf_model)
        if self.valid is not None and not resuming:
            # The untrained model's held-out reward: what training is to raise, reported
            # with step 1 as `valid_reward_initial`.
            with evaluating(rp):
                self._initial = self.evaluate(rp)["valid_reward_mean"]
            log.info("GRPO: untrained valid_reward_mean %.4f", self._initial)

    def _make_sampler(self, hf_model: Any) -> RolloutSampler | None:
        opts = self.options
        longest = max(
            (len(p) for source in (self.train, self.valid) if source for p in source.ids),
            default=0,
        )
        rows = max(self.batch_size * opts.group_size, opts.eval_prompts)
        tokens = min(longest + opts.max_completion_tokens, self.max_positions)
        return make_sampler(
            hf_model,
            rows=rows,
            tokens=tokens,
            streamed_only=opts.generation == "streamed",
            prompt_width=longest,
        )

    def close(self) -> None:
        self.grader.close()
        if self.sampler is not None:
            self.sampler.release()
        if self.reference is not None:
            self.reference.close()
            self.reference = None

    # -- a step

    def _complete(
        self, rp: Any, prompts: list[list[int]], *, step: int | None, max_new_tokens: int
    ) -> list[Completion]:
        """Completions of `prompts` with the current (synced) weights: sampled from step
        `step`'s generator, or greedy (`step` None); by the sampler where there is one."""
        opts = self.options
        limits = {
            "max_new_tokens": max_new_tokens,
            "stop": self.stop,
            "max_positions": self.max_positions,
            "pad_id": self.tokenizer.pad_id,
        }
        draw = (
            None
            if step is None
            else top_p_draw(
                temperature=opts.temperature,
                top_p=opts.top_p,
                generator=step_generator(self.seed, step),
            )
        )
        if self.sampler is not None:
            try:
                self.sampler.refresh()
                return self.sampler.complete(prompts, draw=draw, **limits)
            except torch.OutOfMemoryError:
                # The placement's estimate was short (another process, fragmentation): the
                # job goes on through the engine, which needs no copy, from a fresh draw.
                log.warning("rollout sampler out of GPU memory: sampling through the engine")
                self.sampler.release()
                self.sampler = None
            finally:
                if self.sampler is not None:
                    self.sampler.step_done()
        with evaluating(rp):  # no dropout while sampling
            if draw is None:
                return greedy_completions(rp, prompts, num_microbatch=rp.num_microbatch, **limits)
            return sampled_completions(
                rp,
                prompts,
                num_microbatch=rp.num_microbatch,
                temperature=opts.temperature,
                top_p=opts.top_p,
                generator=step_generator(self.seed, step),
                **limits,
            )

    def _grade(self, completions: list[Completion], items: list[dict[str, Any]]) -> GradeResult:
        texts = [self.tokenizer.decode(c.ids) for c in completions]
        return self.grader.grade([_sample(t) for t in texts], items)

    def _make_rollouts(self, rp: Any, step: int, indices: torch.Tensor) -> _Rollouts:
        """Step `step`'s rollouts of the prompts at `indices`, graded (see the module doc)."""
        opts = self.options
        rows = [int(i) for i in indices for _ in range(opts.group_size)]  # group by group
        prompts = [self.train.ids[i] for i in rows]
        start = time.perf_counter()
        completions = self._complete(
            rp, prompts, step=step, max_new_tokens=opts.max_completion_tokens
        )
        sampled = time.perf_counter()
        graded = self._grade(completions, [self.train.items[i] for i in rows])
        graded_at = time.perf_counter()
        ids, targets = self._sequences(prompts, completions)
        old = None
        if opts.num_iterations > 1:  # the rollout policy, the ratio's denominator
            with evaluating(rp):
                old = self._logps(rp, ids, targets)
        ref = self._reference(rp, ids, targets) if opts.kl_coef > 0 else None
        return _Rollouts(
            step=step,
            rows=rows,
            completions=completions,
            graded=graded,
            ids=ids,
            targets=targets,
            old=old,
            ref=ref,
            rollout_s=sampled - start,
            grading_s=graded_at - sampled,
        )

    def _sequences(
        self, prompts: list[list[int]], completions: list[Completion]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _sequences(
            prompts,
            completions,
            pad_id=self.tokenizer.pad_id,
            max_positions=self.max_positions,
            multiple=self.width_multiple,
        )

    def forward_backward(self, rp: Any, step: int, indices: torch.Tensor) -> tuple[Any, int]:
        opts = self.options
        first = step - (step - 1) % opts.num_iterations  # the step that made this batch
        batch = self._batch
        fresh = batch is None or batch.step != first
        if fresh:
            batch = self._batch = self._make_rollouts(rp, first, indices)
        assert batch is not None
        self._step = step
        rows, completions, graded = batch.rows, batch.completions, batch.graded
        rewards = torch.tensor(graded.scores, dtype=torch.float64)
        advantages = grpo.group_advantages(rewards, opts.group_size, scale=opts.scale_rewards)
        self._values = train_on_rollouts(
            rp, batch.ids, batch.targets, advantages, ref=batch.ref, old=batch.old, options=opts
        )
        self._metrics = _step_metrics(
            rewards,
            graded,
            group=opts.group_size,
            completions=completions,
            rollout_s=batch.rollout_s if fresh else 0.0,
            grading_s=batch.grading_s if fresh else 0.0,
        )
        self._metrics["kl"] = None if opts.kl_coef == 0 else 0.0  # filled by `metrics`
        if self._initial is not None:
            self._metrics["valid_reward_initial"], self._initial = self._initial, None
        if fresh and opts.sample_interval > 0 and step % opts.sample_interval == 0:
            self._emit_samples(step, rows, completions, graded)
        return self._values[0], int((batch.targets != -100).sum())

    def _logps(self, rp: Any, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return grpo.token_logps(
            rp, ids, targets, temperature=self.options.temperature, num_microbatch=rp.num_microbatch
        )

    def _reference(self, rp: Any, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token log-probabilities of the reference, no gradients: the starting weights
        of a full fine-tune, the base with the adapters off of a LoRA one."""
        from engine.adapters.lora import adapters_disabled

        if self.reference is not None:
            return self._logps(self.reference, ids, targets)
        with adapters_disabled(rp):
            return self._logps(rp, ids, targets)

    def _emit_samples(
        self,
        step: int,
        rows: list[int],
        completions: list[Completion],
        graded: GradeResult,
    ) -> None:
        shown = []
        for r in range(min(MAX_SAMPLE_ROWS, len(rows))):
            shown.append(
                {
                    "prompt": self.train.texts[rows[r]],
                    "completion": self.tokenizer.decode(completions[r].ids),
                    "tokens": len(completions[r].ids),
                    "finish_reason": completions[r].finish_reason,
                    "reward": float(graded.scores[r]),
                    "rewards": {k: float(v[r]) for k, v in graded.by_grader.items()},
                }
            )
        tokens = sum(s["tokens"] for s in shown)
        self.emit(
            "sample",
            f"step {step}: {len(shown)} rollouts with rewards",
            {"step": step, "samples": shown, "tokens": tokens, "rollouts": True},
        )

    def metrics(self) -> dict[str, Any]:
        """The step's GRPO metrics (reads its values: a host sync)."""
        assert self._values is not None
        _, kl, clip = (float(v) for v in self._values)
        out = dict(self._metrics)
        if out.get("kl") is not None:
            out["kl"] = round(kl, 6)
        out["clip_fraction"] = round(clip, 6)
        return out

    def evaluate(self, rp: Any) -> dict[str, float]:
        """Mean reward of greedy completions of the first `grpo.eval_prompts` validation
        prompts with the current (synced) weights."""
        assert self.valid is not None
        count = min(len(self.valid), self.options.eval_prompts)
        completions = self._complete(
            rp,
            self.valid.ids[:count],
            step=None,
            max_new_tokens=self.options.max_completion_tokens,
        )
        graded = self._grade(completions, self.valid.items[:count])
        return {"valid_reward_mean": round(sum(graded.scores) / max(count, 1), 6)}

    def state_dict(self) -> dict[str, Any]:
        """Empty, or inside a batch's steps that batch (`_rollouts_state`): the sampler
        is seeded by (seed, step) and the prompt order is the loop's."""
        batch = self._batch
        if batch is None or self._step % self.options.num_iterations == 0:
            return {}
        return {"rollouts": _rollouts_state(batch)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "rollouts" in state:
            self._batch = _rollouts_from_state(state["rollouts"], self)


def train_on_rollouts(
    rp: Any,
    ids: torch.Tensor,
    targets: torch.Tensor,
    advantages: torch.Tensor,
    *,
    ref: torch.Tensor | None,
    old: torch.Tensor | None,
    options: GrpoSection,
) -> list[torch.Tensor]:
    """The GRPO loss's forward and backward through the engine on rollouts `ids` whose
    completion tokens are `targets` (-100 elsewhere); returns the loss function's values
    (loss, KL and clip-fraction shares: `grpo.grpo_loss_fn`)."""
    from engine import RoundPipeRunConfig
    from engine.batch import even_counts

    mask = targets != -100
    denominator, row_tokens = grpo.normalizer(
        options.loss_type, mask, max_completion_tokens=options.max_completion_tokens
    )
    counts = even_counts(ids.shape[0], rp.num_microbatch)
    return rp.forward_backward(
        input_kwargs={"input_ids": ids, "return_logits": False},
        label=(targets, advantages.float(), ref, row_tokens, old),
        loss_fn=grpo.grpo_loss_fn(
            temperature=options.temperature,
            epsilon_low=options.clip_epsilon,
            epsilon_high=options.clip_epsilon_high or options.clip_epsilon,
            beta=options.kl_coef,
            loss_type=options.loss_type,
            denominator=denominator,
            batch_tokens=int(mask.sum()),
        ),
        run_config=RoundPipeRunConfig(
            num_microbatch=len(counts),
            split_input=grpo.split_rows(counts),
            split_label=grpo.split_label(counts),
        ),
    )


def _sequences(
    prompts: list[list[int]],
    completions: list[Completion],
    *,
    pad_id: int,
    max_positions: int = 1 << 30,
    multiple: int = WIDTH_MULTIPLE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids (rows, width), right-padded to a multiple of `multiple` tokens (not past
    `max_positions`), and next-token targets that are the completion's tokens (with its
    end-of-text token) and -100 elsewhere."""
    seqs = []
    for prompt, c in zip(prompts, completions, strict=True):
        tail = c.ids + ([c.stop_id] if c.stop_id is not None else [])
        seqs.append((prompt, tail))
    longest = max(len(p) + len(t) for p, t in seqs)
    width = max(longest, min(-(-longest // multiple) * multiple, max_positions))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    targets = torch.full((len(seqs), width), -100, dtype=torch.long)
    for r, (prompt, tail) in enumerate(seqs):
        full = torch.tensor(prompt + tail, dtype=torch.long)
        ids[r, : len(full)] = full
        if tail:
            # position t predicts token t + 1: the completion's tokens from the prompt's end
            targets[r, len(prompt) - 1 : len(prompt) - 1 + len(tail)] = full[len(prompt) :]
    return ids, targets


def _step_metrics(
    rewards: torch.Tensor,
    graded: Any,
    *,
    group: int,
    completions: list[Completion],
    rollout_s: float,
    grading_s: float,
) -> dict[str, Any]:
    """The step's reward and rollout metrics (the contract's names)."""
    grouped = rewards.view(-1, group)
    return {
        "reward_mean": round(float(rewards.mean()), 6),
        # TRL's reward_std: the groups' standard deviations, averaged
        "reward_std": round(float(grouped.std(dim=1).mean()), 6),
        "rewards": {k: round(sum(v) / len(v), 6) for k, v in graded.by_grader.items() if v},
        "completion_tokens_mean": round(sum(len(c.ids) for c in completions) / len(completions), 3),
        "grader_errors": int(graded.errors),
        "rollout_seconds": round(rollout_s, 4),
        "grading_seconds": round(grading_s, 4),
    }


def _masked(values: torch.Tensor | None, mask: torch.Tensor) -> list[float] | None:
    return None if values is None else values[mask].tolist()


def _unmasked(values: list[float] | None, mask: torch.Tensor) -> torch.Tensor | None:
    """The inverse of `_masked`: 0 off the completion tokens, as `grpo.token_logps` gives."""
    if values is None:
        return None
    out = torch.zeros(mask.shape, dtype=torch.float32)
    out[mask] = torch.tensor(values, dtype=torch.float32)
    return out


def _rollouts_state(batch: _Rollouts) -> dict[str, Any]:
    """A batch of rollouts as JSON: the completions, their grades, and the log-probabilities
    on the completion tokens (fp32 values as Python floats: they read back exactly)."""
    mask = batch.targets != -100
    return {
        "step": batch.step,
        "rows": batch.rows,
        "completions": [[c.ids, c.finish_reason, c.stop_id] for c in batch.completions],
        "scores": batch.graded.scores,
        "by_grader": batch.graded.by_grader,
        "errors": batch.graded.errors,
        "old": _masked(batch.old, mask),
        "ref": _masked(batch.ref, mask),
    }


def _rollouts_from_state(state: dict[str, Any], objective: GrpoObjective) -> _Rollouts:
    rows = [int(r) for r in state["rows"]]
    completions = [
        Completion(ids=list(ids), finish_reason=reason, stop_id=stop)
        for ids, reason, stop in state["completions"]
    ]
    ids, targets = objective._sequences([objective.train.ids[r] for r in rows], completions)
    mask = targets != -100
    graded = GradeResult(
        scores=[float(v) for v in state["scores"]],
        by_grader={k: [float(x) for x in v] for k, v in state["by_grader"].items()},
        errors=int(state["errors"]),
    )
    return _Rollouts(
        step=int(state["step"]),
        rows=rows,
        completions=completions,
        graded=graded,
        ids=ids,
        targets=targets,
        old=_unmasked(state["old"], mask),
        ref=_unmasked(state["ref"], mask),
    )
