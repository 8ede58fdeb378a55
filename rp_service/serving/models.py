"""Model ids: what `ft:<base>:<job-id>`, a job id or a base name resolves to, and the list.

A succeeded job's model id is `ft:<base>:<job-id>`; `<base>` is the job's preset or its
model folder's name, and only the job id after the last colon picks the job. The bare job id names the same model (this daemon's shorthand,
what `rp chat JOB` sends). A base is a preset (listed; a random initialisation, so nothing
to chat with) or a Hugging Face folder under RP_MODEL_ROOTS.

What a model id resolves to (`ServedModel`): the `BaseModel` a serving process loads, and
for a LoRA job the PEFT adapter folder applied on it. Adapters of one base share one
process (`BaseModel.key`). A LoRA job on a preset rebuilds the preset's random
initialisation exactly as the job built it (same config, seed and tokenizer size).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, get_args

from rp_service.data.chat_template import folder_has_template
from rp_service.errors import BadRequest, NotFound
from rp_service.jobs.resolve import under_roots
from rp_service.jobs.store import JobRecord, Store
from rp_service.schemas import ModelSection
from rp_service.settings import Settings

__all__ = [
    "BaseModel",
    "ModelEntry",
    "ServedModel",
    "base_name",
    "fine_tuned_id",
    "has_chat_template",
    "job_id_of",
    "list_models",
    "preset_names",
    "resolve_model",
]

log = logging.getLogger(__name__)

FT_PREFIX = "ft:"
ADAPTER_CONFIG = "adapter_config.json"
ORGANIZATION_ID = "org-roundpipe"  # as the fine-tuning facade's jobs say
_LIST_PAGE = 100


@dataclass(frozen=True, kw_only=True, slots=True)
class BaseModel:
    """The weights a serving process loads: a folder, or a preset's random initialisation.

    Attributes:
        path: a Hugging Face model folder (a base, or a full fine-tune's output).
        preset: a preset name (with `config`, `seed` and the job's `tokenizer` folder, whose
            size the embedding was rounded from) for a LoRA job trained on a preset.
    """

    path: str | None = None
    preset: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    tokenizer: str | None = None

    @property
    def key(self) -> str:
        """Equal for equal weights: one serving process per key."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> BaseModel:
        return cls(**json.loads(text))


@dataclass(frozen=True, kw_only=True, slots=True)
class ServedModel:
    """A model id resolved: the base to load, the adapter on it, the tokenizer to render with."""

    id: str
    base: BaseModel
    adapter: str | None
    tokenizer: str
    job_id: str | None = None
    created: int = 0
    owned_by: str = "system"


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelEntry:
    """One row of `GET /v1/models`."""

    id: str
    created: int
    owned_by: str
    job_id: str | None = None


def preset_names() -> tuple[str, ...]:
    """The presets a JobSpec's `model.preset` accepts."""
    annotation = ModelSection.model_fields["preset"].annotation  # Literal[...] | None
    return tuple(name for arg in get_args(annotation) for name in get_args(arg))


def base_name(job: JobRecord) -> str:
    """The `<base>` of a job's model id: its preset, or its model folder's name."""
    model = job.spec.get("model", {})
    return model.get("preset") or Path(model.get("path") or "model").name


def fine_tuned_id(job: JobRecord) -> str | None:
    """`ft:<base>:<job-id>` of a succeeded job; None before it succeeded."""
    if job.status != "succeeded" or not job.output_model_path:
        return None
    return f"{FT_PREFIX}{base_name(job)}:{job.id}"


def job_id_of(model: str) -> str | None:
    """The job id a model id names (`ft:...:job-x` or `job-x`); None for a base name."""
    if model.startswith(FT_PREFIX):
        job_id = model.rpartition(":")[2]
        return job_id if job_id.startswith("job-") else None
    return model if model.startswith("job-") else None


def has_chat_template(folder: str | Path) -> bool:
    """Whether a tokenizer folder carries a chat template (in either of its saved forms)."""
    return folder_has_template(folder)


def _not_found(model: str, why: str) -> NotFound:
    return NotFound(
        f"the model {model!r} does not exist: {why}; GET /v1/models lists the models here",
        code="model_not_found",
        param="model",
    )


def _base_folders(settings: Settings) -> dict[str, Path]:
    """Name (relative to its root) -> folder of every model folder under RP_MODEL_ROOTS,
    resolved; a folder whose symlinks lead out of every root is left out (the jobs' check,
    `under_roots`)."""
    found: dict[str, Path] = {}
    roots = settings.model_roots
    for root in roots:
        for config in sorted([*root.glob("*/config.json"), *root.glob("*/*/config.json")]):
            name = config.parent.relative_to(root).as_posix()
            resolved = under_roots(str(config.parent.absolute()), roots)
            if name not in found and resolved is not None:
                found[name] = resolved
    return found


def _job_base(model: str, path: str, settings: Settings) -> Path:
    """A LoRA job's base folder, checked again as at submission (it may have been
    replaced by a symlink out of the roots since)."""
    resolved = under_roots(path, settings.model_roots)
    if resolved is None:
        raise _not_found(model, f"its base folder {path!r} is no longer under RP_MODEL_ROOTS")
    return resolved


def _job_model(settings: Settings, store: Store, model: str, job_id: str) -> ServedModel:
    job = store.get_job(job_id)
    if job is None:
        raise _not_found(model, f"no job {job_id!r}")
    canonical = fine_tuned_id(job)
    if canonical is None:
        raise _not_found(model, f"job {job_id} is {job.status}; its model exists once it succeeded")
    if model.startswith(FT_PREFIX) and model != canonical:
        raise _not_found(model, f"job {job_id}'s model is {canonical!r}")
    owner = {
        "job_id": job_id,
        "created": job.finished_at or job.created_at,
        "owned_by": ORGANIZATION_ID,
    }
    out = Path(job.output_model_path or "")
    if not (out / "config.json").is_file() and not (out / ADAPTER_CONFIG).is_file():
        raise _not_found(model, f"job {job_id}'s output folder {str(out)!r} is gone")
    if not (out / ADAPTER_CONFIG).is_file():
        return ServedModel(
            id=canonical, base=BaseModel(path=str(out)), adapter=None, tokenizer=str(out), **owner
        )
    spec = job.spec
    path = spec.get("model", {}).get("path")
    if path is not None:
        base = BaseModel(path=str(_job_base(model, str(path), settings)))
    else:
        base = BaseModel(
            preset=spec["model"]["preset"],
            config=dict(spec["model"].get("config") or {}),
            seed=int(spec.get("train", {}).get("seed", 0)),
            tokenizer=str(out),
        )
    return ServedModel(id=canonical, base=base, adapter=str(out), tokenizer=str(out), **owner)


def resolve_model(
    settings: Settings, store: Store, model: str, *, chat: bool = True
) -> ServedModel | None:
    """The model an id names; blocking (reads the store and the filesystem).

    Args:
        chat: to chat with (presets and models without a chat template are refused);
            False: only to find it (a preset is None).

    Raises:
        NotFound: no such model (OpenAI's 404, `model_not_found`).
        BadRequest: with `chat`, a preset (no trained weights) or no chat template.
    """
    job_id = job_id_of(model)
    if job_id is not None:
        served = _job_model(settings, store, model, job_id)
    elif model in preset_names():
        if not chat:
            return None
        raise BadRequest(
            f"model {model!r} is a preset: a random initialisation with no trained weights to "
            "chat with; chat with a fine-tuned model (ft:...) or a model folder",
            code="model_not_servable",
            param="model",
        )
    else:
        folder = _base_folders(settings).get(model)
        if folder is None:
            raise _not_found(
                model, "it is no fine-tuned model id and no folder under RP_MODEL_ROOTS"
            )
        served = ServedModel(
            id=model,
            base=BaseModel(path=str(folder)),
            adapter=None,
            tokenizer=str(folder),
            created=_mtime(folder / "config.json"),
        )
    if chat and not has_chat_template(served.tokenizer):
        raise BadRequest(
            f"model {model!r} has no chat template: its tokenizer ({served.tokenizer}) defines "
            "none, so messages cannot be rendered; add one (tokenizer.chat_template, saved "
            "with save_pretrained) or use the completions of a chat-trained model",
            code="no_chat_template",
            param="model",
        )
    return served


def _mtime(path: Path) -> int:
    try:
        return int(path.stat().st_mtime)
    except OSError:
        return 0


def list_models(settings: Settings, store: Store) -> list[ModelEntry]:
    """Presets, folders under RP_MODEL_ROOTS, then fine-tuned models newest first; blocking."""
    entries = [ModelEntry(id=p, created=0, owned_by="system") for p in preset_names()]
    for name, folder in _base_folders(settings).items():
        entries.append(
            ModelEntry(id=name, created=_mtime(folder / "config.json"), owned_by="system")
        )
    after: str | None = None
    while True:
        jobs, has_more = store.list_jobs(status="succeeded", after=after, limit=_LIST_PAGE)
        for job in jobs:
            model_id = fine_tuned_id(job)
            if model_id is not None:
                created = job.finished_at or job.created_at
                entries.append(
                    ModelEntry(
                        id=model_id, created=created, owned_by=ORGANIZATION_ID, job_id=job.id
                    )
                )
        if not has_more or not jobs:
            return entries
        after = jobs[-1].id
