"""Atomic, rotating checkpoints: safetensors for tensors, JSON for the rest.

A checkpoint is a directory ``<checkpoint_dir>/step-00000050/``. It is written complete
into a hidden temporary sibling, flushed to disk, then renamed into place, so a directory
with a checkpoint name is always whole: a crash leaves at most a ``.tmp-*`` directory,
which `remove_partial` deletes on the next start. After each commit only the newest
`keep` checkpoints stay.

A training job's checkpoint (`save_training_checkpoint`, `read_training_checkpoint`) holds
four safetensors files (the model copy the next forward reads, the master weights, the
optimizer state, the random generators), the model's config.json and state.json.
"""

from __future__ import annotations

import errno
import json
import logging
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rp_service.checkpoint_dirs import TMP_PREFIX, remove_checkpoint_dir
from rp_service.durable import replacing

__all__ = [
    "CHECKPOINT_VERSION",
    "MASTER_FILE",
    "MODEL_FILE",
    "OPTIMIZER_FILE",
    "RNG_FILE",
    "STATE_FILE",
    "CheckpointInfo",
    "TrainingState",
    "capture_rng",
    "flatten_optimizer_state",
    "latest_checkpoint",
    "list_checkpoints",
    "read_checkpoint",
    "read_training_checkpoint",
    "remove_partial",
    "restore_rng",
    "rotate",
    "save_training_checkpoint",
    "unflatten_optimizer_state",
    "write_checkpoint",
]

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
_NAME = re.compile(r"^step-(\d{8,})$")


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A committed checkpoint directory."""

    step: int
    path: Path


def _dir_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(checkpoint_dir: str | Path) -> list[CheckpointInfo]:
    """Committed checkpoints in `checkpoint_dir`, oldest first."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _NAME.match(child.name)
        if match and (child / STATE_FILE).is_file():
            found.append(CheckpointInfo(step=int(match.group(1)), path=child))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(checkpoint_dir: str | Path) -> CheckpointInfo | None:
    """The newest committed checkpoint, or None."""
    found = list_checkpoints(checkpoint_dir)
    return found[-1] if found else None


def remove_partial(checkpoint_dir: str | Path) -> int:
    """Delete temporary directories left by an interrupted write; return how many."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return 0
    removed = 0
    for child in root.iterdir():
        if child.name.startswith(TMP_PREFIX):
            shutil.rmtree(child, ignore_errors=True)
            removed += 1
    return removed


def rotate(checkpoint_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints; return the deleted paths."""
    found = list_checkpoints(checkpoint_dir)
    doomed = [c.path for c in found[: max(0, len(found) - max(1, keep))]]
    for path in doomed:
        remove_checkpoint_dir(path)  # renamed first: never a half-deleted "committed" dir
    return doomed


def write_checkpoint(
    checkpoint_dir: str | Path,
    step: int,
    *,
    tensors: dict[str, dict[str, torch.Tensor]],
    state: dict[str, Any],
    files: dict[str, bytes] | None = None,
    move_in: list[Path] | None = None,
    keep: int,
    min_free_bytes: int = 0,
) -> tuple[Path, int]:
    """Write and commit the checkpoint of `step`, then rotate; return `(path, size_bytes)`.

    Args:
        tensors: file name (``model.safetensors``) -> tensors saved in it.
        state: JSON-serialisable state, written last as ``state.json``.
        files: other files (name -> bytes), e.g. ``config.json``.
        move_in: files written elsewhere on this disk (other ranks' shards), moved in
            under their names before the commit.
        keep: how many checkpoints to keep after this one is committed.
        min_free_bytes: refuse to start writing (ENOSPC) with less free space than this.
    """
    root = Path(checkpoint_dir)
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    if free < min_free_bytes:
        # Refused before a byte is written: a checkpoint is whole or absent, never half.
        raise OSError(
            errno.ENOSPC,
            f"{free} bytes free, below RP_MIN_FREE_BYTES={min_free_bytes}",
            str(root),
        )
    final = root / _dir_name(step)
    # Written whole under a .tmp- name, then renamed: a failure (a full disk, ENOSPC) gives
    # the space back and never touches the committed checkpoints; the same step again (a
    # resumed run re-saving it) replaces the old folder.
    with replacing(final, directory=True) as tmp:
        for name, group in tensors.items():
            save_file({k: v.detach().contiguous() for k, v in group.items()}, str(tmp / name))
        for name, payload in (files or {}).items():
            (tmp / name).write_bytes(payload)
        for path in move_in or []:
            path.replace(tmp / path.name)
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True))
    size_bytes = sum(p.stat().st_size for p in final.iterdir())
    rotate(root, keep)
    log.info("checkpoint step %d committed: %s (%d bytes)", step, final, size_bytes)
    return final, size_bytes


def read_checkpoint(path: str | Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """Tensors per safetensors file, and the JSON state, of a committed checkpoint."""
    root = Path(path)
    state = json.loads((root / STATE_FILE).read_text())
    tensors = {p.name: load_file(str(p)) for p in sorted(root.glob("*.safetensors"))}
    return tensors, state


# ---------------------------------------------------------------- optimizer state


def flatten_optimizer_state(
    state_dict: dict[str, Any],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split a torch optimizer `state_dict` into safetensors tensors and JSON metadata.

    Tensor entries of the per-parameter state become ``"<param_id>.<key>"``; everything
    else (param groups, non-tensor state) stays in the metadata.
    """
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, entry in state_dict["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{pid}.{key}"] = value.detach().clone().contiguous()
            else:
                scalars.setdefault(str(pid), {})[key] = value
    meta = {"param_groups": state_dict["param_groups"], "scalars": scalars}
    return tensors, meta


def unflatten_optimizer_state(
    tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> dict[str, Any]:
    """Inverse of `flatten_optimizer_state`: a dict for `Optimizer.load_state_dict`."""
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    for pid, entry in meta["scalars"].items():
        state.setdefault(int(pid), {}).update(entry)
    groups = [dict(g) for g in meta["param_groups"]]
    for group in groups:
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
    return {"state": state, "param_groups": groups}


# ---------------------------------------------------------------- RNG


def capture_rng() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The torch (CPU and CUDA), numpy and Python RNG states, as tensors and JSON."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = cuda_state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["numpy"] = torch.from_numpy(np.asarray(keys, dtype=np.uint32).view(np.int32).copy())
    version, internal, gauss_next = random.getstate()
    meta = {
        "numpy": {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "cached": cached},
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
    }
    return tensors, meta


def restore_rng(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Set the RNG states captured by `capture_rng`."""
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted(t for t in tensors if t.startswith("cuda."))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
    np_meta = meta["numpy"]
    keys = tensors["numpy"].numpy().view(np.uint32)
    np.random.set_state(
        (np_meta["kind"], keys, np_meta["pos"], np_meta["has_gauss"], np_meta["cached"])
    )
    py = meta["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))


# ---------------------------------------------------------------- a training job's checkpoint

MODEL_FILE = "model.safetensors"  # HF names, model dtype: what the next forward reads
MASTER_FILE = "master.safetensors"  # the optimizer-side weights, keyed "0", "1", ...
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
CHECKPOINT_VERSION = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingState:
    """A job's checkpoint read back: what a resumed run restores."""

    path: Path
    step: int
    model: dict[str, torch.Tensor]  # the weights the first resumed forward reads
    masters: list[torch.Tensor]  # in the RoundPipe's optim_parameters() order
    optimizer: dict[str, Any]  # an optimizer state_dict
    scheduler: dict[str, Any]  # an lr scheduler state_dict
    trained_tokens: int
    num_blocks: int | None  # training sequences when it was written
    rng_tensors: dict[str, torch.Tensor]
    rng_meta: dict[str, Any]
    # the objective's own state (`Objective.state_dict`); {} in checkpoints from before it
    objective_state: dict[str, Any] = field(default_factory=dict)

    def restore_rng(self) -> None:
        """Put the random generators back to where the checkpoint left them."""
        restore_rng(self.rng_tensors, self.rng_meta)


def save_training_checkpoint(
    checkpoint_dir: str | Path,
    step: int,
    *,
    model: dict[str, torch.Tensor],
    masters: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    progress: dict[str, Any],
    config_json: bytes,
    keep: int,
    min_free_bytes: int = 0,
    shards: list[Path] | None = None,
) -> tuple[Path, int]:
    """Commit the checkpoint of `step` (`write_checkpoint`); return `(path, size_bytes)`.

    Args:
        model: the model-copy weights the next forward reads (all, or a LoRA job's adapters).
        masters: the optimizer-side weights.
        progress: JSON fields of the run beside the step (total_steps, trained_tokens,
            num_blocks, data_position, metrics, method, objective_state).
        config_json: the model's config.json.
        min_free_bytes: as `write_checkpoint`.
        shards: the other ranks' shard files of a multi-node job (rp_service.worker.ranks):
            moved in, and state.json says how many ranks wrote the checkpoint.
    """
    opt_tensors, opt_meta = flatten_optimizer_state(optimizer.state_dict())
    rng_tensors, rng_meta = capture_rng()
    tensors = {
        MODEL_FILE: model,
        MASTER_FILE: {str(i): p.detach().clone() for i, p in enumerate(masters)},
        OPTIMIZER_FILE: opt_tensors,
        RNG_FILE: rng_tensors,
    }
    state = {
        "version": CHECKPOINT_VERSION,
        "step": step,
        **progress,
        "optimizer": opt_meta,
        "scheduler": scheduler.state_dict(),
        "rng": rng_meta,
        "parameter_shapes": [list(p.shape) for p in masters],
    }
    if shards:
        state["world_size"] = len(shards) // 2 + 1  # a tensor file and a JSON a rank
    return write_checkpoint(
        checkpoint_dir,
        step,
        tensors=tensors,
        state=state,
        files={"config.json": config_json},
        move_in=shards,
        keep=keep,
        min_free_bytes=min_free_bytes,
    )


def read_training_checkpoint(info: CheckpointInfo) -> TrainingState:
    """The checkpoint `save_training_checkpoint` wrote at `info`."""
    tensors, state = read_checkpoint(info.path)
    masters = tensors[MASTER_FILE]
    return TrainingState(
        path=info.path,
        step=int(state["step"]),
        model=tensors[MODEL_FILE],
        masters=[masters[str(i)] for i in range(len(masters))],
        optimizer=unflatten_optimizer_state(tensors[OPTIMIZER_FILE], state["optimizer"]),
        scheduler=state["scheduler"],
        trained_tokens=int(state.get("trained_tokens", 0)),
        num_blocks=state.get("num_blocks"),
        rng_tensors=tensors[RNG_FILE],
        rng_meta=state["rng"],
        objective_state=dict(state.get("objective_state") or {}),
    )
