"""The training loop of a job: build everything from the spec, train with the engine, report.

One step is ``forward_backward`` (the engine splits the batch into micro-batches and runs
them over the devices) then ``step(step_fn)``, where `step_fn` clips the fp32 master
gradients, runs the C Adam and advances the lr schedule on the optimizer thread. With
``engine.async_step`` that update overlaps the next step's forward, which reads the updated
weights layer by layer as the optimizer publishes them (``engine.step_staleness: 0``, the
default), or the weights from before the update (``step_staleness: 1``).

Sync points (``synchronize()`` after the step) are the evaluation and checkpoint steps
and the last step; they are part of the spec, so an interrupted run and an uninterrupted
one synchronize at the same steps. A checkpoint stores, besides the step-k master weights
and optimizer state, the weights the next forward will read: the same weights at a sync
point, the step k-1 weights when a pause stops a staleness-one run between sync points. A resumed run
builds the model from the latter and writes the former into the master copy with an
asynchronous "restore" step, so it continues exactly as the uninterrupted run would have.

The batch of every step is a function of the seed and the step (`data.BatchOrder`), so
the data position needs nothing but the step number.

A LoRA job (``train.method: lora``) adds the engine's adapters to the model right after
building it and freezes the rest, so the masters and the optimizer hold the adapters only.
Its checkpoints keep the adapters' model copy, masters and optimizer state, not the base,
which a resumed run rebuilds from the spec exactly as the first one did. Its output is the
PEFT adapter folder, with the merged model in ``merged/`` when ``lora.merge`` asks for it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.adapters.nf4 import host_base_bytes
from engine.options import EngineOptions

from ..data.chat_template import TemplateError, resolve_template
from ..data.datasets import BatchOrder
from ..data.tokenizer import JobTokenizer, load_tokenizer
from ..demo import SYNTHETIC
from ..errors import JobFailure
from ..schemas import JobSpec
from . import checkpoint as ckpt
from .engine_setup import apply_lora, check_host_memory, make_optimizer, wrap, wrap_frozen
from .evaluation import evaluating
from .meter import Emit, Meter
from .modeling import build_model
from .objectives.base import Objective
from .output import MERGED_DIR, save_output
from .ranks import Ranks

__all__ = [
    "Emit",
    "JobPaths",
    "Outcome",
    "lr_factor",
    "run_job",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class JobPaths:
    """The `resolved` section of spec.json: absolute paths the orchestrator checked."""

    train_path: str
    valid_path: str | None
    model_path: str | None
    tokenizer_path: str | None
    output_dir: Path
    # tokenizer.chat_template, checked: 'chatml' or a template file; None: the folder's own
    chat_template: str | None = None
    checkpoint_dir: Path
    # Free bytes a checkpoint must leave on its disk (RP_MIN_FREE_BYTES; 0: no check).
    min_free_bytes: int = 0

    @classmethod
    def from_json(cls, resolved: dict[str, Any]) -> JobPaths:
        return cls(
            train_path=resolved["train_path"],
            valid_path=resolved.get("valid_path"),
            model_path=resolved.get("model_path"),
            tokenizer_path=resolved.get("tokenizer_path"),
            chat_template=resolved.get("chat_template"),
            output_dir=Path(resolved["output_dir"]),
            checkpoint_dir=Path(resolved["checkpoint_dir"]),
            min_free_bytes=int(resolved.get("min_free_bytes") or 0),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """How `run_job` ended: ``succeeded`` (with the model path) or ``paused`` (at `step`)."""

    status: str
    step: int
    output_model_path: str | None = None
    merged_model_path: str | None = None  # a LoRA job's merged model, when lora.merge


def lr_factor(step: int, *, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """Multiplier of the peak lr for 0-based optimizer step `step`.

    Linear warm-up from lr/warmup to lr over `warmup_steps` steps, then `schedule`:
    cosine or linear decay to 0 at the last step, or constant.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


# ---------------------------------------------------------------- building


def _tokenizer_dir(spec: JobSpec, paths: JobPaths) -> str | None:
    if paths.tokenizer_path:
        return paths.tokenizer_path
    if paths.model_path is not None:
        model_dir = Path(paths.model_path)
        if (model_dir / "tokenizer.json").is_file() or (
            model_dir / "tokenizer_config.json"
        ).is_file():
            return str(model_dir)
        raise JobFailure(
            "invalid_tokenizer",
            f"model directory {paths.model_path!r} has no tokenizer; set tokenizer.path",
            param="tokenizer.path",
        )
    return None


def _load_tokenizer(spec: JobSpec, paths: JobPaths) -> JobTokenizer:
    template = None
    if paths.chat_template is not None:
        try:
            template = resolve_template(paths.chat_template)
        except TemplateError as exc:
            raise JobFailure(
                "invalid_tokenizer", str(exc), param="tokenizer.chat_template"
            ) from None
    # TokenizerError: a JobFailure
    return load_tokenizer(_tokenizer_dir(spec, paths), chat_template=template)


# ---------------------------------------------------------------- the job


class _Run:
    """Everything one attempt of a job holds while it trains."""

    def __init__(
        self,
        spec: JobSpec,
        options: EngineOptions,
        paths: JobPaths,
        emit: Emit,
        pause: threading.Event,
    ) -> None:
        self.spec = spec
        self.paths = paths
        self.emit = emit
        self.pause = pause
        self.options = options
        # One process, or a rank of a multi-node job (rp_service.cluster.rank); collective.
        self.ranks = Ranks.current()
        train = spec.train

        self.tokenizer = _load_tokenizer(spec, paths)
        valid_source = paths.valid_path or (SYNTHETIC if spec.data.valid == SYNTHETIC else None)
        self.objective = _make_objective(
            spec, paths, self.tokenizer, valid_source, emit, build_reference=self._build_reference
        )
        self.blocks = self.objective.train
        self.valid = self.objective.valid
        self.order = BatchOrder(
            len(self.blocks),
            train.batch_size,
            seed=train.seed,
            repeat=self.objective.steps_per_batch,
        )
        self.total_steps = train.steps or self.order.steps_for_epochs(train.epochs or 1.0)
        log.info(
            "data: %d train sequences of %d tokens, %s valid, %d steps",
            len(self.blocks),
            spec.data.seq_len,
            len(self.valid) if self.valid is not None else "no",
            self.total_steps,
        )

        ckpt.remove_partial(paths.checkpoint_dir)
        latest = ckpt.latest_checkpoint(paths.checkpoint_dir)
        self.resume = self.ranks.read(latest) if latest is not None else None
        self.start_step = self.resume.step if self.resume is not None else 0
        if self.resume is not None and self.resume.num_blocks != len(self.blocks):
            log.warning(
                "the training data changed since the checkpoint (%s -> %d sequences); "
                "the batch order will differ",
                self.resume.num_blocks,
                len(self.blocks),
            )
        check_host_memory(spec, options, paths.model_path)
        # LoRA: the state_dict names of the adapter weights; None: every weight trains
        self.adapter_keys: list[str] | None = None
        self.hf_model = self._build_model()
        self.rp = wrap(self.hf_model, self.options)
        if getattr(self.rp, "overlap_calls", False):
            log.info("overlapped calls: each step's backward finishes behind the next forward")
        if spec.engine.optim_memory != "compact":  # compact always computes with the update
            # engine.step_staleness: which weights the call after an asynchronous step reads
            self.rp.step_staleness = spec.engine.step_staleness
        # Before any step moves the weights (DPO's full-tuning reference).
        self.objective.prepare(
            self.rp,
            self.hf_model,
            lora=self.adapter_keys is not None,
            resuming=self.resume is not None,
        )
        self.masters = list(self.rp.optim_parameters())
        self.parameters = {
            "trainable": sum(p.numel() for p in self.masters),
            "total": sum(p.numel() for p in self.hf_model.parameters()),
            "base_host_bytes": self.base_host_bytes,
        }
        self.optimizer = make_optimizer(self.masters, options)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.meter = Meter(emit=emit, total_steps=self.total_steps, order=self.order)
        # data parallel's collective seconds (DataParallel.stats) at the last step's event
        self._dp_seen: dict[str, float] = {}
        self.meter.start_step = self.start_step
        if self.resume is not None:
            self._restore(self.resume)

    # -- construction

    def _lr_factor(self, step: int) -> float:
        train = self.spec.train
        return lr_factor(
            step,
            total_steps=self.total_steps,
            warmup_steps=train.warmup_steps,
            schedule=train.schedule,
        )

    def _build_base(self) -> torch.nn.Module:
        """The model as the spec builds it, before adapters and checkpoints: the same
        weights at every call (a preset's from the job's seed, a folder's as stored)."""
        model = self.spec.model
        return build_model(  # ModelError: a JobFailure naming the model field
            preset=model.preset,
            config_overrides=dict(model.config),
            path=self.paths.model_path,
            dtype=model.dtype,
            vocab_size=self.tokenizer.vocab_size,
            seed=self.spec.train.seed,
            quantization=self.options.quantization,
        )

    def _build_reference(self) -> Any:
        """A GRPO full fine-tune's KL reference: the starting weights, built again (a
        resumed attempt's model holds the checkpoint's), frozen, wrapped for forwards."""
        log.info("GRPO: building the KL reference (the starting weights, frozen)")
        return wrap_frozen(self._build_base(), self.options)

    def _build_model(self) -> torch.nn.Module:
        hf_model = self._build_base()
        # The base as stored, before the adapters and the wrap (which may re-home storage).
        self.base_host_bytes = host_base_bytes(hf_model)
        if self.options.lora is not None:
            # A preset's build seeded the generator and the adapters continue its stream;
            # loading a model directory draws nothing, so the adapters are seeded there.
            seed = self.spec.train.seed if self.paths.model_path is not None else None
            self.adapter_keys = apply_lora(hf_model, self.options.lora, seed=seed)
        if self.resume is not None:
            # The weights the first resumed forward reads (see the module docstring).
            self._load_model_tensors(hf_model, self.resume.model)
        return hf_model

    def _load_model_tensors(
        self, hf_model: torch.nn.Module, saved: dict[str, torch.Tensor]
    ) -> None:
        if self.adapter_keys is None:
            hf_model.load_state_dict(saved, strict=True)
            return
        # A LoRA checkpoint holds the adapters only; the frozen base is rebuilt as it was.
        if sorted(saved) != sorted(self.adapter_keys):
            raise JobFailure(
                "checkpoint_mismatch",
                f"checkpoint {self.resume.path} holds other adapter tensors than the "
                "model's; the model or lora spec changed since it was written",
                param="lora",
            )
        hf_model.load_state_dict(saved, strict=False)

    def _model_tensors(self) -> dict[str, torch.Tensor]:
        """Copies of the model-copy weights a checkpoint keeps: all, or the adapters only."""
        state = self.hf_model.state_dict()
        keys = state.keys() if self.adapter_keys is None else self.adapter_keys
        return {k: state[k].detach().clone() for k in keys}

    def _restore(self, resume: ckpt.TrainingState) -> None:
        if len(resume.masters) != len(self.masters):
            raise JobFailure(
                "checkpoint_mismatch",
                f"checkpoint {resume.path} has {len(resume.masters)} tensors, the model "
                f"{len(self.masters)}; the model spec changed since it was written",
                param="model",
            )

        def restore_fn() -> None:
            with torch.no_grad():
                for p, t in zip(self.masters, resume.masters, strict=True):
                    p.copy_(t)
            self.optimizer.load_state_dict(resume.optimizer)
            self.scheduler.load_state_dict(resume.scheduler)

        # Asynchronous like a training step, so the next forward reads the model copy the
        # checkpoint recorded for it while the master copy becomes the step-k weights.
        self.rp.step(restore_fn, is_async=self.options.async_step)
        resume.restore_rng()
        self.objective.load_state_dict(resume.objective_state)
        self.meter.trained_tokens = resume.trained_tokens
        log.info("resumed from %s at step %d", resume.path, self.start_step)

    # -- one step

    def _step_fn(self, step: int) -> Callable[[], None]:
        clip = self.spec.train.grad_clip

        # engine.optim.Adam (make_optimizer) sums the norm on every core and folds the
        # clip's multiply into its update: torch's clip_grad_norm_ is two passes over the
        # fp32 gradients (~1 s a step for 1.7B parameters on a 16-core host), on the
        # staleness-zero step's path.

        def step_fn() -> None:
            # On the optimizer thread: `masters` are the fp32 master weights and their grads.
            start = time.perf_counter()
            if self.ranks.world > 1:
                # Each rank steps its shard: the norm is over every rank's rows (collective).
                from engine.parallel.data_parallel import grad_norm

                norm = grad_norm(self.rp)
                if clip is not None:
                    self.optimizer.clip_grad_norm_(clip, total_norm=norm)
            elif clip is not None:
                norm = self.optimizer.clip_grad_norm_(clip)
            else:
                norm = self.optimizer.grad_norm()
            lr = self.scheduler.get_last_lr()[0]  # the rate this update uses
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.scheduler.step()
            timing = {"step_s": round(time.perf_counter() - start, 4), **self._collective_s()}
            self.meter.updates.put((step, float(norm), lr, timing))

        return step_fn

    def _collective_s(self) -> dict[str, float]:
        """Data parallel's seconds on the optimizer thread since the last step's event:
        reducing gradients (during the backward) and publishing weights (all-gathers);
        nothing for one process."""
        dp = getattr(self.rp, "_dp", None)
        if dp is None:
            return {}
        now = {key: dp.stats[key] for key in ("reduce_s", "publish_s")}
        seen, self._dp_seen = self._dp_seen, now
        return {key: round(now[key] - seen.get(key, 0.0), 4) for key in now}

    def _forward_backward(self, step: int) -> tuple[torch.Tensor, int]:
        if self.objective.needs_sync_before_step:
            self.rp.synchronize()  # the objective reads the model copy: the update is in
        return self.objective.forward_backward(self.rp, step, self.order.indices(step - 1))

    def evaluate(self) -> dict[str, float]:
        """The objective's validation metrics with the current (synced) weights."""
        assert self.valid is not None
        return self.objective.evaluate(self.rp)

    def sample(self, step: int) -> tuple[str, dict[str, Any]]:
        """The `sample` event of `step`: train.sample_prompts completed with the current
        (synced) weights; a user turn in the chat template unless the data is plain text
        (``text``, ``prompt_completion``)."""
        from .sampling import sample_event

        train = self.spec.train
        return sample_event(
            self.rp,
            self.hf_model,
            step=step,
            prompts=train.sample_prompts,
            tokenizer=self.tokenizer,
            # rendered as the data was: chat and pairs in the template, plain text as is
            chat=self.objective.data_format in ("chat", "preference", "prompt"),
            max_new_tokens=train.sample_max_tokens,
        )

    # -- checkpoints and output

    def _sync_point(self, step: int) -> bool:
        train = self.spec.train
        return (
            step == self.total_steps
            or (train.eval_interval > 0 and step % train.eval_interval == 0)
            or (train.checkpoint_interval > 0 and step % train.checkpoint_interval == 0)
        )

    def save_checkpoint(self, step: int, next_model: dict[str, torch.Tensor] | None) -> None:
        """Commit the checkpoint of `step` (call with no step in flight)."""
        if next_model is None:  # at a sync point the model copy holds the step-k weights
            next_model = self._model_tensors()
        metrics = {k: self.meter.last.get(k) for k in ("train_loss", "valid_loss", "learning_rate")}
        shards = None
        if self.ranks.world > 1:
            shards = self.ranks.write_shard(
                self.paths.checkpoint_dir, step, self.masters, self.optimizer
            )
            if self.ranks.rank > 0:
                return  # rank 0 commits the checkpoint with this rank's shard in it
        path, size_bytes = ckpt.save_training_checkpoint(
            self.paths.checkpoint_dir,
            step,
            model=next_model,
            masters=self.masters,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            progress={
                "total_steps": self.total_steps,
                "trained_tokens": self.meter.trained_tokens,
                "num_blocks": len(self.blocks),
                "data_position": self.order.position(step),
                "metrics": metrics,
                "method": self.spec.train.method,
                "objective": self.spec.train.objective,
                "objective_state": self.objective.state_dict(),
            },
            config_json=self.hf_model.config.to_json_string().encode(),
            keep=self.spec.train.keep_checkpoints,
            min_free_bytes=self.paths.min_free_bytes,
            shards=shards,
        )
        if shards:
            self.ranks.staging_dir(self.paths.checkpoint_dir, step).rmdir()  # emptied
        data = {"step": step, "path": str(path), "metrics": metrics, "size_bytes": size_bytes}
        self.emit("checkpoint", f"checkpoint at step {step}", data)

    def save_output(self) -> Path:
        """Write the final model (or adapter) and tokenizer; return the output directory."""
        lora = self.spec.lora
        return save_output(
            self.paths.output_dir,
            hf_model=self.hf_model,
            rp=self.rp,
            tokenizer=self.tokenizer,
            adapters=self.adapter_keys is not None,
            merge=lora is not None and lora.merge,
            metrics=self.meter.last,
        )

    # -- the loop

    def _pause_asked(self) -> bool:
        """Whether to pause (SIGUSR1); every rank of a multi-node job gets one answer."""
        return self.ranks.any(self.pause.is_set())

    def train(self) -> Outcome:
        train = self.spec.train
        async_step = self.options.async_step
        self.emit(
            "status",
            "running",
            {
                "status": "running",
                "step": self.start_step,
                "total_steps": self.total_steps,
                "parameters": self.parameters,
            },
        )
        self.meter.start_time = time.perf_counter()
        step = self.start_step
        while step < self.total_steps:
            if self._pause_asked() and step == self.start_step:
                # Nothing trained in this attempt: the newest checkpoint already is this state.
                return Outcome(status="paused", step=step)
            step += 1
            loss_t, tokens = self._forward_backward(step)
            sync = self._sync_point(step)
            pausing = self._pause_asked() and step < self.total_steps
            next_model = None
            if pausing and not sync and async_step and self.rp.step_staleness == 1:
                # The next forward of an uninterrupted run would read the step-(k-1) weights:
                # keep them, then finish step k.
                self.rp.synchronize()
                next_model = self._model_tensors()
            self.rp.step(self._step_fn(step), is_async=async_step)
            loss = float(loss_t)  # the one host sync of a step
            extra = self.objective.metrics()
            self.meter.record(step, loss, tokens, extra)
            if not (sync or pausing):
                self.meter.flush()
                continue
            self.rp.synchronize()
            valid: dict[str, float] | None = None
            eval_step = train.eval_interval > 0 and step % train.eval_interval == 0
            leader = self.ranks.rank == 0  # evaluation and samples: no collectives, rank 0's
            if leader and self.valid is not None and (eval_step or step == self.total_steps):
                with evaluating(self.rp):
                    valid = self.evaluate()
            self.meter.flush(valid=valid)
            if leader and train.sample_prompts and (eval_step or step == self.total_steps):
                with evaluating(self.rp):
                    self.emit("sample", *self.sample(step))
            checkpoint = train.checkpoint_interval > 0 and step % train.checkpoint_interval == 0
            if checkpoint or pausing or step == self.total_steps:
                self.save_checkpoint(step, next_model)
            if pausing:
                return Outcome(status="paused", step=step)
        self.rp.synchronize()
        self.meter.flush()
        if self.ranks.rank > 0:  # every rank holds the same final weights: rank 0 writes them
            return Outcome(status="succeeded", step=step)
        out = self.save_output()
        merged = out / MERGED_DIR
        return Outcome(
            status="succeeded",
            step=step,
            output_model_path=str(out),
            merged_model_path=str(merged) if self.adapter_keys and merged.is_dir() else None,
        )


def _make_objective(
    spec: JobSpec,
    paths: JobPaths,
    tokenizer: JobTokenizer,
    valid_source: str | None,
    emit: Emit,
    *,
    build_reference: Callable[[], Any],
) -> Objective:
    """The objective `train.objective` names, its data read (`build_reference`: a GRPO
    full fine-tune's KL reference, built when the objective asks)."""
    objective = spec.train.objective
    if objective == "dpo":
        from .objectives.dpo_job import DpoObjective

        return DpoObjective(spec, paths, tokenizer, valid_source=valid_source)
    if objective == "grpo":
        from .objectives.grpo_job import GrpoObjective

        return GrpoObjective(
            spec,
            paths,
            tokenizer,
            valid_source=valid_source,
            emit=emit,
            build_reference=build_reference,
        )
    from .objectives.sft import SftObjective

    return SftObjective(spec, paths, tokenizer, valid_source=valid_source)


def run_job(
    spec: JobSpec,
    options: EngineOptions,
    paths: JobPaths,
    emit: Emit,
    pause: threading.Event,
) -> Outcome:
    """Train the job described by `spec` with `options` (`spec_to_engine(spec)`, mapped
    once, at submission); return how it ended.

    Raises:
        JobFailure: bad data, tokenizer or model (with the spec field to fix).
    """
    run = _Run(spec, options, paths, emit, pause)
    try:
        return run.train()
    finally:
        run.objective.close()
