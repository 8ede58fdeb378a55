"""A GRPO job's side of the training loop: its prompts, rollouts, rewards and step.

Each step (`forward_backward`), with the weights the previous update published (the loop
synchronizes first, `needs_sync_before_step`):

1. rollouts: the step's `train.batch_size` prompts, each `grpo.group_size` times, sampled
   together through the engine's forward (`sampling.sampled_completions`, temperature and
   top-p) from a generator seeded by (train.seed, step): a resumed attempt draws what the
   uninterrupted one drew, with no sampler state to store;
2. rewards: the grader scores every completion against its prompt's row (one `grade`
   call a step); a grader error scores 0 and is counted (`grader_errors`);
3. the loss (`grpo.grpo_loss_fn`) on the completion tokens (the end-of-text token that
   closed a completion included, so stopping is learned), with the k3 KL to the base with
   the adapters off when `grpo.kl_coef` > 0 (LoRA only: the spec refuses it otherwise).

The engine keeps no KV cache: each new token is one forward over the whole batch so far
(see `sampling`). Where a step's time goes is in its metrics: `rollout_seconds`,
`grading_seconds`, the rest being the training forward and backward.

The prompt order is the loop's `BatchOrder` (a function of the seed and the step), so a
checkpoint needs nothing beyond what the loop keeps; `state_dict` is empty.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...data.formats import DataFormatError, iter_records
from ...data.prompts import PromptRows, build_prompts, synthetic_prompts
from ...demo import SYNTHETIC
from ...errors import JobFailure
from ...graders import GraderConfigError, Sample, build_grader, python_graders_allowed
from ..evaluation import evaluating
from ..sampling import greedy_completions, sampled_completions, stop_ids
from . import grpo

if TYPE_CHECKING:
    from ...data.tokenizer import JobTokenizer
    from ...graders import Grader
    from ...schemas import JobSpec
    from ..meter import Emit
    from ..sampling import Sample as Completion
    from ..training import JobPaths

__all__ = ["MAX_SAMPLE_ROWS", "GrpoObjective", "step_generator"]

log = logging.getLogger(__name__)

MAX_SAMPLE_ROWS = 8  # rollouts shown in a `sample` event
SYNTHETIC_TRAIN_PROMPTS, SYNTHETIC_VALID_PROMPTS = 256, 16  # the demo's generated rows
_SEED_STRIDE = 1_000_003  # a prime: (seed, step) pairs map to distinct generator seeds


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
    ) -> None:
        assert spec.grpo is not None and spec.grader is not None  # JobSpec's rules
        self.options = spec.grpo
        self.seed = spec.train.seed
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
        self.max_positions = 1 << 30
        self.stop: set[int] = set()
        self._values: list[torch.Tensor] | None = None
        self._metrics: dict[str, Any] = {}
        self._initial: float | None = None

    # -- setup

    def prepare(self, rp: Any, hf_model: Any, *, lora: bool, resuming: bool) -> None:
        self.lora = lora
        positions = getattr(hf_model.config, "max_position_embeddings", None)
        self.max_positions = positions or self.max_positions
        self.stop = stop_ids(self.tokenizer, getattr(hf_model, "generation_config", None))
        if self.valid is not None and not resuming:
            # The untrained model's held-out reward: what training is to raise, reported
            # with step 1 as `valid_reward_initial`.
            with evaluating(rp):
                self._initial = self.evaluate(rp)["valid_reward_mean"]
            log.info("GRPO: untrained valid_reward_mean %.4f", self._initial)

    def close(self) -> None:
        self.grader.close()

    # -- a step

    def _rollouts(self, rp: Any, prompts: list[list[int]], step: int) -> list[Completion]:
        opts = self.options
        with evaluating(rp):  # no dropout while sampling
            return sampled_completions(
                rp,
                prompts,
                max_new_tokens=opts.max_completion_tokens,
                stop=self.stop,
                max_positions=self.max_positions,
                pad_id=self.tokenizer.pad_id,
                num_microbatch=rp.num_microbatch,
                temperature=opts.temperature,
                top_p=opts.top_p,
                generator=step_generator(self.seed, step),
            )

    def _grade(
        self, completions: list[Completion], items: list[dict[str, Any]]
    ) -> tuple[list[str], Any]:
        texts = [self.tokenizer.decode(c.ids) for c in completions]
        return texts, self.grader.grade([_sample(t) for t in texts], items)

    def forward_backward(self, rp: Any, step: int, indices: torch.Tensor) -> tuple[Any, int]:
        from engine import RoundPipeRunConfig

        opts = self.options
        group = opts.group_size
        rows = [int(i) for i in indices for _ in range(group)]  # group by group
        prompts = [self.train.ids[i] for i in rows]
        start = time.perf_counter()
        completions = self._rollouts(rp, prompts, step)
        sampled = time.perf_counter()
        texts, graded = self._grade(completions, [self.train.items[i] for i in rows])
        graded_at = time.perf_counter()
        rewards = torch.tensor(graded.scores, dtype=torch.float64)
        advantages = grpo.group_advantages(rewards, group, scale=opts.scale_rewards).float()

        ids, targets = _sequences(prompts, completions, pad_id=self.tokenizer.pad_id)
        mask = targets != -100
        denominator, row_tokens = grpo.normalizer(
            opts.loss_type, mask, max_completion_tokens=opts.max_completion_tokens
        )
        ref = self._reference(rp, ids, targets) if opts.kl_coef > 0 else None
        counts = _row_counts(len(rows), rp.num_microbatch)
        self._values = rp.forward_backward(
            input_kwargs={"input_ids": ids, "return_logits": False},
            label=(targets, advantages, ref, row_tokens),
            loss_fn=grpo.grpo_loss_fn(
                temperature=opts.temperature,
                epsilon_low=opts.clip_epsilon,
                epsilon_high=opts.clip_epsilon_high or opts.clip_epsilon,
                beta=opts.kl_coef,
                loss_type=opts.loss_type,
                denominator=denominator,
                batch_tokens=int(mask.sum()),
            ),
            run_config=RoundPipeRunConfig(
                num_microbatch=len(counts),
                split_input=grpo.split_rows(counts),
                split_label=grpo.split_label(counts),
            ),
        )
        self._metrics = _step_metrics(
            rewards,
            graded,
            group=group,
            completions=completions,
            rollout_s=sampled - start,
            grading_s=graded_at - sampled,
        )
        self._metrics["kl"] = None if opts.kl_coef == 0 else 0.0  # filled by `metrics`
        if self._initial is not None:
            self._metrics["valid_reward_initial"], self._initial = self._initial, None
        if opts.sample_interval > 0 and step % opts.sample_interval == 0:
            self._emit_samples(step, rows, completions, texts, graded)
        return self._values[0], int(mask.sum())

    def _reference(self, rp: Any, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token log-probabilities of the base (the adapters off), no gradients."""
        from engine.adapters.lora import adapters_disabled

        with adapters_disabled(rp):
            return grpo.token_logps(
                rp,
                ids,
                targets,
                temperature=self.options.temperature,
                num_microbatch=rp.num_microbatch,
            )

    def _emit_samples(
        self,
        step: int,
        rows: list[int],
        completions: list[Completion],
        texts: list[str],
        graded: Any,
    ) -> None:
        shown = []
        for r in range(min(MAX_SAMPLE_ROWS, len(rows))):
            shown.append(
                {
                    "prompt": self.train.texts[rows[r]],
                    "completion": texts[r],
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
        completions = greedy_completions(
            rp,
            self.valid.ids[:count],
            max_new_tokens=self.options.max_completion_tokens,
            stop=self.stop,
            max_positions=self.max_positions,
            pad_id=self.tokenizer.pad_id,
            num_microbatch=rp.num_microbatch,
        )
        _, graded = self._grade(completions, self.valid.items[:count])
        return {"valid_reward_mean": round(sum(graded.scores) / max(count, 1), 6)}

    def state_dict(self) -> dict[str, Any]:
        return {}  # the sampler is seeded by (seed, step); the prompt order is the loop's

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _row_counts(rows: int, num_microbatch: int) -> list[int]:
    from engine.batch import even_counts

    return even_counts(rows, num_microbatch)


def _sequences(
    prompts: list[list[int]], completions: list[Completion], *, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids (rows, width), right-padded, and next-token targets that are the
    completion's tokens (with its end-of-text token) and -100 elsewhere."""
    seqs = []
    for prompt, c in zip(prompts, completions, strict=True):
        tail = c.ids + ([c.stop_id] if c.stop_id is not None else [])
        seqs.append((prompt, tail))
    width = max(len(p) + len(t) for p, t in seqs)
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
