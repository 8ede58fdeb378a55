"""The training loop of a job: build everything from the spec, train with the engine, report.

One step is ``forward_backward`` (the engine splits the batch into micro-batches and runs
them over the devices) then ``step(step_fn)``, where `step_fn` clips the fp32 master
gradients, runs the C Adam and advances the lr schedule on the optimizer thread. With
``engine.async_step`` that update overlaps the next step's forward, which therefore reads
the weights from before the update (staleness 1).

Sync points (``synchronize()`` after the step) are the evaluation and checkpoint steps
and the last step; they are part of the spec, so an interrupted run and an uninterrupted
one synchronize at the same steps. A checkpoint stores, besides the step-k master weights
and optimizer state, the weights the next forward will read: the same weights at a sync
point, the step k-1 weights when a pause stops the run between sync points. A resumed run
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

import json
import logging
import math
import queue
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..data.datasets import BatchOrder, DataFormatError, TokenBlocks, build_blocks, read_records
from ..data.tokenizer import JobTokenizer, TokenizerError, load_tokenizer
from ..demo import SYNTHETIC, SYNTHETIC_TRAIN_RECORDS, SYNTHETIC_VALID_RECORDS, synthetic_records
from ..schemas import JobSpec
from . import checkpoint as ckpt
from .modeling import DTYPES, ModelError, build_model

__all__ = [
    "Emit",
    "JobFailure",
    "JobPaths",
    "Outcome",
    "lr_factor",
    "run_job",
]

log = logging.getLogger(__name__)

Emit = Callable[..., None]
"""`emit(type, message, data, level="info")`: write one event."""

_MAX_EVAL_BLOCKS = 256  # validation sequences per evaluation (the first ones, in order)
_EVAL_LOGITS = 1 << 28  # logits elements per evaluation forward
_SPEED_WINDOW = 20  # steps over which tokens/s is averaged
MODEL_FILE = "model.safetensors"  # HF names, model dtype: what the next forward reads
MASTER_FILE = "master.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
CHECKPOINT_VERSION = 1
MERGED_DIR = "merged"  # a LoRA job's merged model, inside its adapter output folder
_LORA_FIELDS = ("lora.rank", "lora.alpha", "lora.dropout", "lora.target_modules")


class JobFailure(Exception):
    """The job cannot run as specified; becomes the error event `{code, message, param}`."""

    def __init__(
        self, code: str, message: str, *, param: str | None = None, **details: Any
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.details = details


@dataclass(frozen=True, kw_only=True, slots=True)
class JobPaths:
    """The `resolved` section of spec.json: absolute paths the orchestrator checked."""

    train_path: str
    valid_path: str | None
    model_path: str | None
    tokenizer_path: str | None
    output_dir: Path
    checkpoint_dir: Path

    @classmethod
    def from_json(cls, resolved: dict[str, Any]) -> JobPaths:
        return cls(
            train_path=resolved["train_path"],
            valid_path=resolved.get("valid_path"),
            model_path=resolved.get("model_path"),
            tokenizer_path=resolved.get("tokenizer_path"),
            output_dir=Path(resolved["output_dir"]),
            checkpoint_dir=Path(resolved["checkpoint_dir"]),
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


def _load_blocks(
    source: str, param: str, spec: JobSpec, tokenizer: JobTokenizer, *, valid: bool
) -> TokenBlocks:
    data = spec.data
    try:
        if source == SYNTHETIC:
            count = SYNTHETIC_VALID_RECORDS if valid else SYNTHETIC_TRAIN_RECORDS
            fmt, records = "text", synthetic_records(count, seed=0, valid=valid)
        else:
            if not Path(source).is_file():
                raise JobFailure("invalid_data", f"{param}: file {source!r} not found", param=param)
            fmt, records = read_records(source, data.format)
        return build_blocks(records, fmt, tokenizer, seq_len=data.seq_len, packing=data.packing)
    except DataFormatError as exc:
        where = f"{param} line {exc.line}: " if exc.line else f"{param}: "
        raise JobFailure("invalid_data", where + exc.message, param=param, line=exc.line) from exc


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
    try:
        return load_tokenizer(_tokenizer_dir(spec, paths))
    except TokenizerError as exc:
        raise JobFailure("invalid_tokenizer", str(exc), param="tokenizer.path") from exc


# ---------------------------------------------------------------- metrics


@dataclass(slots=True)
class _Meter:
    """Per-step metrics: waits for each step's grad norm, then emits its event."""

    emit: Emit
    total_steps: int
    order: BatchOrder
    start_time: float = field(default_factory=time.perf_counter)
    start_step: int = 0
    trained_tokens: int = 0
    pending: deque[dict[str, Any]] = field(default_factory=deque)
    grad_norms: queue.SimpleQueue[tuple[int, float]] = field(default_factory=queue.SimpleQueue)
    speed: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=_SPEED_WINDOW))
    last: dict[str, Any] = field(default_factory=dict)

    def record(
        self, step: int, loss: float, lr: float, tokens: int, extra: dict[str, Any] | None = None
    ) -> None:
        """Note step `step` (1-based) as done on the main thread; `extra`: the objective's
        own metrics (DPO's rewards and log-probabilities)."""
        now = time.perf_counter()
        # this step's wall time: since the previous step, or since this attempt started
        step_seconds = now - (self.speed[-1][0] if self.speed else self.start_time)
        self.trained_tokens += tokens
        self.speed.append((now, tokens))
        if len(self.speed) > 1:
            span = now - self.speed[0][0]
            tokens_per_s = sum(t for _, t in list(self.speed)[1:]) / span if span > 0 else 0.0
        else:
            tokens_per_s = tokens / max(now - self.start_time, 1e-9)
        done = step - self.start_step
        eta = (now - self.start_time) / done * (self.total_steps - step) if done else None
        self.pending.append(
            {
                "step": step,
                "total_steps": self.total_steps,
                "epoch": round(self.order.epoch(step), 6),
                "train_loss": loss,
                "valid_loss": None,
                "learning_rate": lr,
                "grad_norm": None,
                "tokens_per_second": round(tokens_per_s, 3),
                "step_seconds": round(step_seconds, 4),
                "trained_tokens": self.trained_tokens,
                "gpu_mem_bytes": _gpu_mem_bytes(),
                "eta_seconds": None if eta is None else round(eta, 3),
                **(extra or {}),
            }
        )

    def flush(self, *, valid_loss: float | None = None) -> None:
        """Emit every pending step whose grad norm has arrived (all of them after a sync)."""
        while True:
            try:
                step, norm = self.grad_norms.get_nowait()
            except queue.Empty:
                return
            data = self.pending.popleft()
            if data["step"] != step:  # the optimizer thread runs steps in order
                raise RuntimeError(f"grad norm of step {step} arrived for step {data['step']}")
            data["grad_norm"] = norm
            if not self.pending and valid_loss is not None:
                data["valid_loss"] = valid_loss
            self.last = data
            message = f"step {step}/{self.total_steps} loss {data['train_loss']:.4f}"
            if data["valid_loss"] is not None:
                message += f" valid {data['valid_loss']:.4f}"
            self.emit("metrics", message, data)


def _gpu_mem_bytes() -> int:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    return sum(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count()))


# ---------------------------------------------------------------- the job


class _Run:
    """Everything one attempt of a job holds while it trains."""

    def __init__(self, spec: JobSpec, paths: JobPaths, emit: Emit, pause: threading.Event) -> None:
        self.spec = spec
        self.paths = paths
        self.emit = emit
        self.pause = pause
        train = spec.train

        self.tokenizer = _load_tokenizer(spec, paths)
        valid_source = paths.valid_path or (SYNTHETIC if spec.data.valid == SYNTHETIC else None)
        # train.objective dpo: pairs instead of blocks, its own step and evaluation
        self.dpo: Any = None
        if train.objective == "dpo":
            from .objectives.dpo_job import DpoObjective

            self.dpo = DpoObjective(spec, paths, self.tokenizer, valid_source=valid_source)
            self.blocks: Any = self.dpo.train
            self.valid: Any = self.dpo.valid
        else:
            self.blocks = _load_blocks(
                paths.train_path, "data.train", spec, self.tokenizer, valid=False
            )
            self.valid = (
                _load_blocks(valid_source, "data.valid", spec, self.tokenizer, valid=True)
                if valid_source
                else None
            )
        self.order = BatchOrder(len(self.blocks), train.batch_size, seed=train.seed)
        self.total_steps = train.steps or self.order.steps_for_epochs(train.epochs or 1.0)
        log.info(
            "data: %d train sequences of %d tokens, %s valid, %d steps",
            len(self.blocks),
            spec.data.seq_len,
            len(self.valid) if self.valid is not None else "no",
            self.total_steps,
        )

        ckpt.remove_partial(paths.checkpoint_dir)
        self.resume_from = ckpt.latest_checkpoint(paths.checkpoint_dir)
        self.start_step = 0
        resume_tensors: dict[str, dict[str, torch.Tensor]] = {}
        resume_state: dict[str, Any] = {}
        if self.resume_from is not None:
            resume_tensors, resume_state = ckpt.read_checkpoint(self.resume_from.path)
            self.start_step = int(resume_state["step"])
            if resume_state.get("num_blocks") != len(self.blocks):
                log.warning(
                    "the training data changed since the checkpoint (%s -> %d sequences); "
                    "the batch order will differ",
                    resume_state.get("num_blocks"),
                    len(self.blocks),
                )
        # LoRA: the state_dict names of the adapter weights; None: every weight trains
        self.adapter_keys: list[str] | None = None
        self._check_host_memory()
        self.hf_model = self._build_model(resume_tensors)
        self.rp = self._wrap()
        if self.dpo is not None:  # the full-tuning reference: before any step moves weights
            self.dpo.prepare(
                self.rp, lora=self.adapter_keys is not None, resuming=self.resume_from is not None
            )
        self.masters = list(self.rp.optim_parameters())
        self.parameters = {
            "trainable": sum(p.numel() for p in self.masters),
            "total": sum(p.numel() for p in self.hf_model.parameters()),
        }
        self.optimizer = self._optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.meter = _Meter(emit=emit, total_steps=self.total_steps, order=self.order)
        self.meter.start_step = self.start_step
        if self.resume_from is not None:
            self._restore(resume_tensors, resume_state)

    # -- construction

    def _lr_factor(self, step: int) -> float:
        train = self.spec.train
        return lr_factor(
            step,
            total_steps=self.total_steps,
            warmup_steps=train.warmup_steps,
            schedule=train.schedule,
        )

    def _check_host_memory(self) -> None:
        """The submission's host-memory plan again, against what this box has now (another
        job may hold memory the daemon could not count at submission): refuse before
        allocating rather than be ended by the OOM killer."""
        from engine.device import host_memory_budget_setting
        from engine.planning.memory_plan import default_budget_bytes, process_rss_bytes

        from ..errors import InvalidRequest
        from ..jobs.hostmem import check_spec

        config = None
        if self.paths.model_path is not None:
            config = json.loads((Path(self.paths.model_path) / "config.json").read_text())
        budget = default_budget_bytes(
            host_memory_budget_setting(), in_use_bytes=process_rss_bytes()
        )
        cuda = torch.cuda.is_available() and self.spec.engine.gpus > 0
        try:
            check_spec(self.spec, path_config=config, cuda=cuda, budget=budget)
        except InvalidRequest as exc:
            raise JobFailure("host_memory_exceeded", exc.message, param=exc.param) from None

    def _build_model(self, resume_tensors: dict[str, dict[str, torch.Tensor]]) -> torch.nn.Module:
        model = self.spec.model
        try:
            hf_model = build_model(
                preset=model.preset,
                config_overrides=dict(model.config),
                path=self.paths.model_path,
                dtype=model.dtype,
                vocab_size=self.tokenizer.vocab_size,
                seed=self.spec.train.seed,
            )
        except ModelError as exc:
            raise JobFailure("invalid_model", exc.message, param=exc.param) from exc
        if self.spec.train.method == "lora":
            self._apply_lora(hf_model)
        if resume_tensors:
            # The weights the first resumed forward reads (see the module docstring).
            self._load_model_tensors(hf_model, resume_tensors[MODEL_FILE])
        return hf_model

    def _apply_lora(self, hf_model: torch.nn.Module) -> None:
        """Add the spec's adapters in place and freeze the base weights."""
        from engine.adapters.lora import LoraConfig, apply_lora
        from engine.errors import ConfigError

        lora = self.spec.lora
        assert lora is not None  # JobSpec fills the defaults for method lora
        config = LoraConfig(
            rank=lora.rank,
            alpha=lora.alpha,
            dropout=lora.dropout,
            target_modules=tuple(lora.target_modules),
        )
        # The adapters' random init is part of the job's reproducible state. A preset's
        # build seeded the generator and the adapters continue its stream; loading a model
        # directory draws nothing, so seed here (not for a preset too: its base and the
        # adapters would start from the same random numbers).
        if self.paths.model_path is not None:
            torch.manual_seed(self.spec.train.seed)
        try:
            apply_lora(hf_model, config)
        except ConfigError as exc:
            message = str(exc)  # the engine's messages start with the field they are about
            param = next(
                (f for f in _LORA_FIELDS if message.startswith(f)),
                "lora",
            )
            raise JobFailure("invalid_lora", message, param=param) from exc
        self.adapter_keys = [n for n, p in hf_model.named_parameters() if p.requires_grad]
        if not self.adapter_keys:
            raise JobFailure(
                "invalid_lora",
                f"lora.target_modules {lora.target_modules} matched no layer of the model",
                param="lora.target_modules",
            )
        log.info("LoRA: %d adapter tensors on %s", len(self.adapter_keys), lora.target_modules)

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
                f"checkpoint {self.resume_from.path} holds other adapter tensors than the "
                "model's; the model or lora spec changed since it was written",
                param="lora",
            )
        hf_model.load_state_dict(saved, strict=False)

    def _model_tensors(self) -> dict[str, torch.Tensor]:
        """Copies of the model-copy weights a checkpoint keeps: all, or the adapters only."""
        state = self.hf_model.state_dict()
        keys = state.keys() if self.adapter_keys is None else self.adapter_keys
        return {k: state[k].detach().clone() for k in keys}

    def _wrap(self) -> Any:
        import engine.models as presets
        from engine import RoundPipeRunConfig, wrap_model_to_roundpipe

        engine = self.spec.engine
        run_config = RoundPipeRunConfig(
            num_microbatch=engine.num_microbatch, recompute_grain=engine.recompute_grain
        )
        presets.RECOMPUTE_ATTENTION = engine.recompute_attention
        in_place = engine.optim_grad_dtype == "model"  # read the downloaded gradient itself
        return wrap_model_to_roundpipe(
            self.hf_model,
            optim_dtype=DTYPES[engine.optim_dtype],
            optim_grad_dtype=DTYPES[self.spec.model.dtype] if in_place else None,
            model_run_config=run_config,
            pin_model=engine.pin_model,
        )

    def _optimizer(self) -> torch.optim.Optimizer:
        from engine.optim import Adam

        train = self.spec.train
        return Adam(
            self.masters,
            lr=train.lr,
            betas=tuple(train.betas),
            weight_decay=train.weight_decay,
            decoupled_weight_decay=True,
            state_dtype=DTYPES[self.spec.engine.optim_state_dtype],
        )

    def _restore(self, tensors: dict[str, dict[str, torch.Tensor]], state: dict[str, Any]) -> None:
        masters = tensors[MASTER_FILE]
        if len(masters) != len(self.masters):
            raise JobFailure(
                "checkpoint_mismatch",
                f"checkpoint {self.resume_from.path} has {len(masters)} tensors, the model "
                f"{len(self.masters)}; the model spec changed since it was written",
                param="model",
            )
        saved = [masters[str(i)] for i in range(len(self.masters))]
        opt_state = ckpt.unflatten_optimizer_state(tensors[OPTIMIZER_FILE], state["optimizer"])
        sched_state = state["scheduler"]

        def restore_fn() -> None:
            with torch.no_grad():
                for p, t in zip(self.masters, saved, strict=True):
                    p.copy_(t)
            self.optimizer.load_state_dict(opt_state)
            self.scheduler.load_state_dict(sched_state)

        # Asynchronous like a training step, so the next forward reads the model copy the
        # checkpoint recorded for it while the master copy becomes the step-k weights.
        self.rp.step(restore_fn, is_async=self.spec.engine.async_step)
        ckpt.restore_rng(tensors[RNG_FILE], state["rng"])
        self.meter.trained_tokens = int(state.get("trained_tokens", 0))
        log.info("resumed from %s at step %d", self.resume_from.path, self.start_step)

    # -- one step

    def _step_fn(self, step: int) -> Callable[[], None]:
        clip = self.spec.train.grad_clip

        def step_fn() -> None:
            # On the optimizer thread: `masters` are the fp32 master weights and their grads.
            if clip is not None:
                norm = torch.nn.utils.clip_grad_norm_(self.masters, clip)
            else:
                grads = [p.grad for p in self.masters if p.grad is not None]
                norm = torch.nn.utils.get_total_norm(grads)
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.scheduler.step()
            self.meter.grad_norms.put((step, float(norm)))

        return step_fn

    def _forward_backward(self, step: int) -> tuple[torch.Tensor, int]:
        from engine.models import causal_lm_loss_fn

        if self.dpo is not None:
            return self.dpo.forward_backward(self.rp, self.order.indices(step - 1))
        input_ids, labels, tokens = self.blocks.batch(self.order.indices(step - 1))
        loss_fn = causal_lm_loss_fn(labels, shifted=True)
        loss = self.rp.forward_backward(
            input_kwargs={"input_ids": input_ids, "return_logits": False},
            label=labels,
            loss_fn=loss_fn,
        )
        return loss, tokens

    def evaluate(self) -> float:
        """Mean token loss over the validation sequences with the current (synced) weights."""
        from engine.models import causal_lm_loss

        if self.dpo is not None:
            return self.dpo.evaluate(self.rp)
        assert self.valid is not None
        count = min(len(self.valid), _MAX_EVAL_BLOCKS)
        # The forward returns full logits to the host: bound them to ~_EVAL_LOGITS elements.
        vocab = int(self.hf_model.config.vocab_size)
        per_row = self.valid.seq_len * vocab
        rows = max(1, min(self.spec.train.batch_size, _EVAL_LOGITS // per_row))
        total, tokens = 0.0, 0
        with torch.no_grad():
            for start in range(0, count, rows):
                idx = torch.arange(start, min(start + rows, count))
                input_ids, labels, _ = self.valid.batch(idx)
                logits = self.rp(input_ids)
                total += float(causal_lm_loss(logits, labels, num_items_in_batch=1, shifted=True))
                tokens += int((labels != -100).sum())
        return total / max(tokens, 1)

    # -- checkpoints and output

    def _sync_point(self, step: int) -> bool:
        train = self.spec.train
        return (
            step == self.total_steps
            or (train.eval_interval > 0 and step % train.eval_interval == 0)
            or (train.checkpoint_interval > 0 and step % train.checkpoint_interval == 0)
        )

    def _master_tensors(self) -> dict[str, torch.Tensor]:
        return {str(i): p.detach().clone() for i, p in enumerate(self.masters)}

    def save_checkpoint(self, step: int, next_model: dict[str, torch.Tensor] | None) -> None:
        """Commit the checkpoint of `step` (call with no step in flight)."""
        opt_tensors, opt_meta = ckpt.flatten_optimizer_state(self.optimizer.state_dict())
        rng_tensors, rng_meta = ckpt.capture_rng()
        if next_model is None:  # at a sync point the model copy holds the step-k weights
            next_model = self._model_tensors()
        tensors = {
            MODEL_FILE: next_model,
            MASTER_FILE: self._master_tensors(),
            OPTIMIZER_FILE: opt_tensors,
            RNG_FILE: rng_tensors,
        }
        metrics = {k: self.meter.last.get(k) for k in ("train_loss", "valid_loss", "learning_rate")}
        state = {
            "version": CHECKPOINT_VERSION,
            "step": step,
            "total_steps": self.total_steps,
            "trained_tokens": self.meter.trained_tokens,
            "num_blocks": len(self.blocks),
            "data_position": self.order.position(step),
            "optimizer": opt_meta,
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_meta,
            "metrics": metrics,
            "parameter_shapes": [list(p.shape) for p in self.masters],
            "method": self.spec.train.method,
            "objective": self.spec.train.objective,
        }
        config = self.hf_model.config.to_json_string().encode()
        path, size_bytes = ckpt.write_checkpoint(
            self.paths.checkpoint_dir,
            step,
            tensors=tensors,
            state=state,
            files={"config.json": config},
            keep=self.spec.train.keep_checkpoints,
        )
        data = {"step": step, "path": str(path), "metrics": metrics, "size_bytes": size_bytes}
        self.emit("checkpoint", f"checkpoint at step {step}", data)

    def save_output(self) -> Path:
        """Write the final model (HF format) and tokenizer; return the output directory.

        A LoRA job's output directory is the PEFT adapter folder (adapter_config.json +
        adapter_model.safetensors), with the merged model in its ``merged/`` subdirectory
        when ``lora.merge`` asks for one.
        """
        out = self.paths.output_dir
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            if self.adapter_keys is None:
                self.hf_model.save_pretrained(str(tmp), safe_serialization=True)
            else:
                lora = self.spec.lora
                merged = tmp / MERGED_DIR if lora is not None and lora.merge else None
                self.rp.save_adapter(str(tmp), merged_path=None if merged is None else str(merged))
                if merged is not None:
                    self.tokenizer.save(merged)
            self.tokenizer.save(tmp)
            (tmp / "training_metrics.json").write_text(json.dumps(self.meter.last, indent=1))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # e.g. ENOSPC: free what was written
            raise
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        return out

    # -- the loop

    def train(self) -> Outcome:
        train = self.spec.train
        async_step = self.spec.engine.async_step
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
            if self.pause.is_set() and step == self.start_step:
                # Nothing trained in this attempt: the newest checkpoint already is this state.
                return Outcome(status="paused", step=step)
            step += 1
            loss_t, tokens = self._forward_backward(step)
            sync = self._sync_point(step)
            pausing = self.pause.is_set() and step < self.total_steps
            next_model = None
            if pausing and not sync and async_step:
                # The next forward of an uninterrupted run would read the step-(k-1) weights:
                # keep them, then finish step k.
                self.rp.synchronize()
                next_model = self._model_tensors()
            self.rp.step(self._step_fn(step), is_async=async_step)
            loss = float(loss_t)  # the one host sync of a step
            lr = train.lr * self._lr_factor(step - 1)
            extra = self.dpo.metrics() if self.dpo is not None else None
            self.meter.record(step, loss, lr, tokens, extra)
            if not (sync or pausing):
                self.meter.flush()
                continue
            self.rp.synchronize()
            valid_loss = None
            evaluate = train.eval_interval > 0 and step % train.eval_interval == 0
            if self.valid is not None and (evaluate or step == self.total_steps):
                valid_loss = self.evaluate()
            self.meter.flush(valid_loss=valid_loss)
            checkpoint = train.checkpoint_interval > 0 and step % train.checkpoint_interval == 0
            if checkpoint or pausing or step == self.total_steps:
                self.save_checkpoint(step, next_model)
            if pausing:
                return Outcome(status="paused", step=step)
        self.rp.synchronize()
        self.meter.flush()
        out = self.save_output()
        merged = out / MERGED_DIR
        return Outcome(
            status="succeeded",
            step=step,
            output_model_path=str(out),
            merged_model_path=str(merged) if self.adapter_keys and merged.is_dir() else None,
        )


def run_job(spec: JobSpec, paths: JobPaths, emit: Emit, pause: threading.Event) -> Outcome:
    """Train the job described by `spec`; return how it ended.

    Raises:
        JobFailure: bad data, tokenizer or model (with the spec field to fix).
    """
    return _Run(spec, paths, emit, pause).train()
