"""Check a JobSpec against this daemon (roots, files, model limits) and resolve its paths.

Pydantic checks each value alone; this module checks what needs the daemon's state: that
a file id exists, that a local path lies under a configured root once symlinks are
resolved, that `data.seq_len` fits the model, that enough GPUs (or cluster nodes) exist,
that they can do what the spec asks of them (FP8 matmuls).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import Any

from engine.catalog import FAMILIES, max_lora_rank, projection_shapes
from engine.options import FP8_MIN_CAPABILITY, EngineOptions, fp8_capable
from engine.planning.memory_plan import format_gib
from rp_service.cluster.nodes import ClusterView, check_nodes_request
from rp_service.data.chat_template import CHOOSE_HINT, folder_has_template
from rp_service.data.formats import DataFormatError, iter_records
from rp_service.errors import HostMemoryExceeded, InvalidRequest, JobFailure
from rp_service.jobs.gpu_mode import (
    GpuMode,
    choose_gpu_mode,
    overlap_by_default,
    overlap_refusal,
)
from rp_service.jobs.hostmem import budget_bytes, check_spec, plan_for_spec
from rp_service.jobs.store import Store
from rp_service.jobs.weights import check_weights_cover
from rp_service.schemas import JobSpec, LoraSection
from rp_service.settings import Settings
from rp_service.spec_to_engine import spec_to_engine

__all__ = [
    "SpecResolver",
    "check_fp8_devices",
    "check_lora_rank",
    "config_max_positions",
    "under_roots",
]


def _within(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
    except ValueError:
        return False
    return True


def under_roots(raw: str, roots: list[Path]) -> Path | None:
    """The resolved path when `raw` is absolute, exists and lies under one of `roots`.

    None otherwise, for a missing path and for one outside alike, so neither can be told
    from the other. A path outside every root by its text is refused before the file
    system is asked anything about it; symlinks are then resolved and checked again.
    """
    path = Path(raw)
    if not path.is_absolute():
        return None
    lexical = Path(os.path.normpath(path))
    bases = [Path(os.path.normpath(root.absolute())) for root in roots]
    if not any(_within(lexical, base) for base in bases):
        bases_resolved = [root.resolve() for root in roots]  # a root given through a symlink
        if not any(_within(lexical, base) for base in bases_resolved):
            return None
    try:
        resolved = path.resolve(strict=True)
    except (OSError, RuntimeError):
        return None
    if any(_within(resolved, root.resolve()) for root in roots):
        return resolved
    return None


def _under_roots(raw: str, roots: list[Path], *, param: str, env: str) -> Path:
    """The resolved path, if it exists and lies under one of `roots`; else InvalidRequest."""
    if not roots:
        raise InvalidRequest(
            f"{param}: local paths are disabled on this daemon; set {env} to allow directories, "
            "or upload the data with POST /v1/files",
            code="path_not_allowed",
            param=param,
        )
    if not Path(raw).is_absolute():
        raise InvalidRequest(
            f"{param}: give an absolute path under {env} ({', '.join(map(str, roots))}); got {raw!r}",
            code="path_not_allowed",
            param=param,
        )
    resolved = under_roots(raw, roots)
    if resolved is None:
        # One message for "missing" and "outside": which files exist is not told.
        raise InvalidRequest(
            f"{param}: {raw!r} is not an existing path under the allowed roots "
            f"{env}={','.join(map(str, roots))}",
            code="path_not_allowed",
            param=param,
        )
    return resolved


def check_lora_rank(lora: LoraSection, config: dict[str, Any]) -> None:
    """Raise InvalidRequest (param ``lora.rank``) when the rank is above an adapted layer's
    `engine.catalog.max_lora_rank` (the engine refuses it as well, later)."""
    shapes = projection_shapes(config)
    if shapes is None:
        return
    limits = {name: max_lora_rank(*shapes[name]) for name in lora.target_modules}
    narrowest = min(limits, key=lambda name: limits[name])
    limit = limits[narrowest]
    if lora.rank > limit:
        fan_in, fan_out = shapes[narrowest]
        raise InvalidRequest(
            f"lora.rank: {lora.rank} is above the width of the model's {narrowest} layers "
            f"({fan_in} -> {fan_out} features); use a rank of at most {limit}",
            code="lora_rank_too_large",
            param="lora.rank",
        )


def check_fp8_devices(spec: JobSpec, capabilities: Sequence[str | None]) -> None:
    """Refuse `engine.matmul_precision: fp8` unless the job runs on GPUs that multiply in
    float8: CUDA compute capability >= 8.9 on every GPU the daemon hands out (a job may get
    any of them), none of it on CPU devices.

    Args:
        capabilities: Each schedulable GPU's compute capability ('9.0'); None where unknown.
    """
    if spec.engine.matmul_precision != "fp8":
        return
    field = "engine.matmul_precision"
    need = "{}.{}".format(*FP8_MIN_CAPABILITY)
    if not capabilities or spec.engine.gpus == 0:
        where = "engine.gpus is 0" if capabilities else "this daemon has no GPUs"
        raise InvalidRequest(
            f"{field}: fp8 needs CUDA GPUs of compute capability >= {need} and this job "
            f"would run on CPU devices ({where}); set {field} to 'bf16'",
            code="fp8_needs_gpu",
            param=field,
        )
    lacking = [
        f"GPU {i} ({cap or 'capability unknown'})"
        for i, cap in enumerate(capabilities)
        if cap is None or not fp8_capable(cap)
    ]
    if lacking:
        raise InvalidRequest(
            f"{field}: fp8 needs GPUs of compute capability >= {need} (Ada, Hopper or "
            f"newer); this daemon's {', '.join(lacking)} cannot multiply in float8; set "
            f"{field} to 'bf16'",
            code="fp8_unsupported_gpu",
            param=field,
        )


def _holds_messages(path: str, fmt: str) -> bool:
    """Whether a dataset's first record is chat: messages, or a pair with a message prompt."""
    if path == "synthetic":
        return False
    try:
        for _, line_format, record in iter_records(path, fmt):
            if line_format == "chat":
                return True
            return line_format == "preference" and not isinstance(record.get("prompt"), str)
    except (DataFormatError, OSError):
        return False  # the worker reports a bad file with its line; this check only adds
    return False


def config_max_positions(config: dict[str, Any] | None) -> int | None:
    """A config.json's `max_position_embeddings` when it is a positive integer, else None."""
    value = config.get("max_position_embeddings") if config is not None else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


# The data format each objective needs (None: any but those another objective needs).
_OBJECTIVE_FORMATS = {"dpo": "preference", "grpo": "prompt"}
_FORMAT_WORDS = {"preference": "preference pairs", "prompt": "prompt rows"}


def _check_format_for_objective(param: str, raw: str, fmt: str, objective: str) -> None:
    """Refuse an uploaded file whose records the objective does not train on."""
    want = _OBJECTIVE_FORMATS.get(objective)
    if want == fmt or (want is None and fmt not in _FORMAT_WORDS):
        return
    fitting = next((o for o, f in _OBJECTIVE_FORMATS.items() if f == fmt), "sft")
    needs = _FORMAT_WORDS.get(want or "", "text, chat or prompt-completion records")
    raise InvalidRequest(
        f"{param}: file {raw} holds {fmt} records but train.objective {objective!r} trains "
        f"on {needs}; set train.objective to {fitting!r} or upload other data",
        code="format_mismatch",
        param=param,
    )


def check_grader(spec: JobSpec) -> None:
    """Refuse a grader this daemon cannot run (a python grader without
    RP_ALLOW_PYTHON_GRADERS=1, an unknown metric, a bad formula), naming its field."""
    if spec.grader is None:
        return
    import tempfile

    from rp_service.graders import GraderConfigError, build_grader, python_graders_allowed

    try:
        with tempfile.TemporaryDirectory(prefix="rp-grader-check-") as workdir:
            build_grader(
                spec.grader, allow_python=python_graders_allowed(), workdir=Path(workdir)
            ).close()
    except GraderConfigError as exc:
        raise InvalidRequest(exc.message, code="invalid_grader", param=exc.field) from None


class SpecResolver:
    """Checks specs at submission and resolves them for the worker at start."""

    def __init__(self, settings: Settings, store: Store) -> None:
        self.settings = settings
        self.store = store
        # The Ray cluster's view, set by the orchestrator when RP_RAY_ADDRESS is.
        self.cluster: ClusterView | None = None

    def check(
        self,
        spec: JobSpec,
        *,
        gpu_count: int,
        gpu_capabilities: Sequence[str | None] | None = None,
    ) -> EngineOptions:
        """Raise InvalidRequest or JobFailure, naming the field, for what this daemon
        cannot run (what its devices cannot do first, then the engine options' rules:
        `spec_to_engine`); return the options, which the job keeps for every launch.

        Args:
            gpu_capabilities: The compute capability of each GPU the daemon schedules
                (None: unknown, `gpu_count` of them).
        """
        if gpu_capabilities is None:
            gpu_capabilities = [None] * gpu_count
        # Before the options' rules: on a daemon without FP8 GPUs, "set model.dtype to
        # bfloat16" would be the wrong advice (and the OpenAI facade's jobs have no dtype).
        check_fp8_devices(spec, gpu_capabilities)
        options = spec_to_engine(spec)
        path_config = self._path_config(spec)  # config.json of a model folder, read once
        if spec.model.path is not None and path_config is not None:
            folder = self._model_dir(spec.model.path, param="model.path")
            check_weights_cover(folder, path_config, param="model.path")
        max_positions = self._max_positions(spec, path_config)
        if max_positions is not None and spec.data.seq_len > max_positions:
            raise InvalidRequest(
                f"data.seq_len: {spec.data.seq_len} is above the model's maximum of "
                f"{max_positions} positions (max_position_embeddings); use at most {max_positions}",
                code="seq_len_too_long",
                param="data.seq_len",
            )
        if spec.lora is not None:
            config = self._model_config(spec, path_config)
            if config is not None:
                check_lora_rank(spec.lora, config)
        if spec.tokenizer.path is not None:
            self._model_dir(spec.tokenizer.path, param="tokenizer.path")
        check_grader(spec)
        train_path = self._data(
            "data.train", spec.data.train, spec.data.format, spec.train.objective
        )
        self._check_template(spec, train_path)
        if spec.data.valid is not None:
            self._data("data.valid", spec.data.valid, spec.data.format, spec.train.objective)
        check_nodes_request(spec, self.settings)
        if spec.engine.nodes > 1:
            if self.cluster is not None:  # engine.gpus is per node there, checked by Ray
                self.cluster.check(spec)
        elif gpu_count > 0 and spec.engine.gpus > gpu_count:
            raise InvalidRequest(
                f"engine.gpus: {spec.engine.gpus} requested but this daemon has {gpu_count} "
                f"GPU(s); use 0..{gpu_count}",
                code="not_enough_gpus",
                param="engine.gpus",
            )
        cap, limit = spec.engine.max_gpu_memory_gib, self.settings.gpu_memory_gib
        if cap is not None and limit is not None and cap > limit:
            raise InvalidRequest(
                f"engine.max_gpu_memory_gib: {cap:g} GiB is above this daemon's limit of "
                f"{limit:g} GiB a job (RP_GPU_MEMORY_GIB); use at most {limit:g}, or null for "
                "the limit itself",
                code="gpu_memory_above_limit",
                param="engine.max_gpu_memory_gib",
            )
        check_spec(
            spec,
            options,
            path_config=path_config,
            cuda=gpu_count > 0 and spec.engine.gpus > 0,
            budget=self.host_budget_bytes,
        )
        return options

    def gpu_mode(self, spec: JobSpec, options: EngineOptions, *, gpu_count: int) -> GpuMode:
        """How the job runs on its GPUs (`choose_gpu_mode`; after `check`): InvalidRequest
        when engine.gpu_mode 'ranks' cannot run it."""
        path_config = self._path_config(spec)
        cuda = gpu_count > 0 and spec.engine.gpus > 0

        def rank_plan_bytes(ranks: int) -> int | None:
            plan = plan_for_spec(spec, options, path_config=path_config, cuda=cuda, ranks=ranks)
            return None if plan is None else plan.total_bytes

        return choose_gpu_mode(
            spec,
            options,
            on_gpus=cuda,
            rank_plan_bytes=rank_plan_bytes,
            budget=self.host_budget_bytes,
        )

    def overlap_calls(
        self, spec: JobSpec, options: EngineOptions, mode: GpuMode, *, gpu_count: int
    ) -> tuple[EngineOptions, GpuMode]:
        """The options and mode with engine.overlap_calls decided (after `gpu_mode`, whose
        plain plan `check` found within the budget): InvalidRequest when `true` cannot run,
        HostMemoryExceeded naming engine.overlap_calls when its memory (a second weight
        copy, a second call's activations) does not fit; `auto` turns it on only where it
        fits."""
        asked = spec.engine.overlap_calls
        if asked is False:
            return options, mode
        cuda = gpu_count > 0 and spec.engine.gpus > 0
        if asked is True:
            refusal = overlap_refusal(spec, mode)
            if refusal is not None:
                raise InvalidRequest(
                    f"engine.overlap_calls: {refusal}; or set engine.overlap_calls to 'auto' "
                    "or false",
                    code="overlap_not_possible",
                    param="engine.overlap_calls",
                )
        elif not overlap_by_default(spec, mode, on_gpus=cuda):
            return options, mode
        overlapped = replace(options, overlap_calls=True)
        path_config = self._path_config(spec)
        plan = plan_for_spec(spec, overlapped, path_config=path_config, cuda=cuda)
        budget = self.host_budget_bytes
        if plan is None or plan.total_bytes <= budget:
            return overlapped, replace(mode, overlap_calls=True)
        if asked == "auto":
            return options, mode  # calls one after the other fit: they run so
        raise HostMemoryExceeded(
            f"engine.overlap_calls: overlapped calls need about {format_gib(plan.total_bytes)} "
            f"of host memory (a second copy of the weights and a second call's activations), "
            f"over this daemon's budget of {format_gib(budget)} (RP_HOST_MEMORY_BUDGET); set "
            "engine.overlap_calls to 'auto' or false",
            param="engine.overlap_calls",
            need_bytes=plan.total_bytes,
            budget_bytes=budget,
            parts_bytes=plan.parts,
            options=[{"param": "engine.overlap_calls", "change": "false"}],
        )

    def legacy_options(self, spec: JobSpec) -> dict[str, Any]:
        """The options of a job queued by a daemon from before the store kept them (`check`
        maps a new job's): mapped now, at its launch. A refusal is an InvalidRequest."""
        try:
            return spec_to_engine(spec).to_json()
        except JobFailure as exc:
            raise InvalidRequest(exc.message, code=exc.code, param=exc.param) from None

    @cached_property
    def host_budget_bytes(self) -> int:
        """Host bytes one job may use, fixed at the first use (start-up)."""
        return budget_bytes(self.settings.host_memory_budget)

    def resolve(self, spec: JobSpec, job_dir: Path) -> dict[str, Any]:
        """The `resolved` section of the worker's spec.json."""
        model_path = (
            str(self._model_dir(spec.model.path, param="model.path")) if spec.model.path else None
        )
        tokenizer_path = (
            str(self._model_dir(spec.tokenizer.path, param="tokenizer.path"))
            if spec.tokenizer.path
            else None
        )
        return {
            "train_path": self._data(
                "data.train", spec.data.train, spec.data.format, spec.train.objective
            ),
            "valid_path": (
                self._data("data.valid", spec.data.valid, spec.data.format, spec.train.objective)
                if spec.data.valid is not None
                else None
            ),
            "model_path": model_path,
            "tokenizer_path": tokenizer_path,
            "chat_template": self._template_choice(spec),
            "output_dir": str(job_dir / "output"),
            "checkpoint_dir": str(job_dir / "checkpoints"),
            "min_free_bytes": self.settings.min_free_bytes,
            **self._cluster_fields(spec),
        }

    def _cluster_fields(self, spec: JobSpec) -> dict[str, Any]:
        """What rp_service.cluster.driver reads besides the paths (engine.nodes > 1)."""
        if spec.engine.nodes <= 1:
            return {}
        # queued before a restart without RP_RAY_ADDRESS: fails at start, naming the field
        check_nodes_request(spec, self.settings)
        return {
            "ray_address": self.settings.ray_address,
            "shared_dir": str(self.settings.shared_dir),
        }

    def _template_choice(self, spec: JobSpec) -> str | None:
        """`tokenizer.chat_template` as the worker reads it: 'chatml' or a checked path."""
        choice = spec.tokenizer.chat_template
        if choice is None or choice == "chatml":
            return choice
        param = "tokenizer.chat_template"
        path = _under_roots(choice, self.settings.model_roots, param=param, env="RP_MODEL_ROOTS")
        if not path.is_file():
            raise InvalidRequest(
                f"{param}: {choice!r} is not a file; give 'chatml' or a Jinja template file",
                param=param,
            )
        return str(path)

    def _check_template(self, spec: JobSpec, train_path: str) -> None:
        """Refuse chat data for a model folder whose tokenizer has no chat template and
        for which the spec chose none: nothing would say how to render the messages."""
        source = spec.tokenizer.path or spec.model.path
        if self._template_choice(spec) is not None or source is None:
            return  # chosen, or the built-in byte tokenizer's ChatML
        folder = self._model_dir(source, param="tokenizer.path")
        if folder_has_template(folder) or not _holds_messages(train_path, spec.data.format):
            return
        raise InvalidRequest(
            f"data.train holds chat messages, but the tokenizer in {str(folder)!r} has no "
            f"chat template to render them with; {CHOOSE_HINT} (it is saved with the "
            "trained model, so chat and serving render the same way)",
            code="no_chat_template",
            param="data.train",
        )

    def _model_dir(self, raw: str, *, param: str) -> Path:
        path = _under_roots(raw, self.settings.model_roots, param=param, env="RP_MODEL_ROOTS")
        if not path.is_dir():
            raise InvalidRequest(f"{param}: {raw!r} is not a directory", param=param)
        if param == "model.path" and not (path / "config.json").is_file():
            raise InvalidRequest(
                f"{param}: {raw!r} has no config.json; give a Hugging Face model directory",
                code="invalid_model_dir",
                param=param,
            )
        return path

    def _max_positions(self, spec: JobSpec, path_config: dict[str, Any] | None) -> int | None:
        if spec.model.preset is not None:
            override = spec.model.config.get("max_position_embeddings")
            if isinstance(override, int) and not isinstance(override, bool) and override > 0:
                return override
            return FAMILIES[spec.model.preset].max_positions
        return config_max_positions(path_config)

    def _path_config(self, spec: JobSpec) -> dict[str, Any] | None:
        """config.json of `model.path` (None for a preset)."""
        if spec.model.path is None:
            return None
        config_path = self._model_dir(spec.model.path, param="model.path") / "config.json"
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError, RecursionError):  # RecursionError: nested too deep
            raise InvalidRequest(
                f"model.path: {config_path} is not readable JSON",
                code="invalid_model_dir",
                param="model.path",
            ) from None
        return config if isinstance(config, dict) else None

    def _model_config(
        self, spec: JobSpec, path_config: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        """The model's HF config fields: a preset's defaults with the overrides, or config.json."""
        if spec.model.preset is not None:
            defaults = FAMILIES[spec.model.preset].config_defaults
            if defaults is None:
                return None  # no shape defaults here: the worker checks the rank (invalid_lora)
            return {**defaults, **spec.model.config}
        return path_config

    def _data(self, param: str, raw: str, fmt: str, objective: str) -> str:
        if raw == "synthetic":
            return "synthetic"
        if raw.startswith("file-"):
            record = self.store.get_file(raw)
            if record is None:
                raise InvalidRequest(
                    f"{param}: no uploaded file with id {raw!r}; upload it with POST /v1/files "
                    "or list them with GET /v1/files",
                    code="file_not_found",
                    param=param,
                )
            if fmt != "auto" and record.format != fmt:
                raise InvalidRequest(
                    f"{param}: file {raw} holds {record.format} records but data.format is {fmt!r}",
                    code="format_mismatch",
                    param=param,
                )
            _check_format_for_objective(param, raw, record.format, objective)
            return record.path
        path = _under_roots(raw, self.settings.dataset_roots, param=param, env="RP_DATASET_ROOTS")
        if not path.is_file():
            raise InvalidRequest(f"{param}: {raw!r} is not a file", param=param)
        return str(path)
