"""The stored reference log-probabilities of a full fine-tuning DPO job.

Taken once, before the first step, by a forward-only pass over every pair, and written
into the job directory (next to ``checkpoints/``) atomically: a temporary file, fsync,
rename, fsync of the directory. A pause, a resume or a crash of the worker or the daemon
finds the file and loads it bit for bit; it is never recomputed once training may have
moved the weights. The file records a digest of the tokenised pairs it belongs to, so
changed data is noticed rather than scored against the wrong numbers.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rp_service.durable import fsync_path

__all__ = ["REFERENCE_FILE", "data_digest", "read_reference", "write_reference"]

REFERENCE_FILE = "reference_logps.safetensors"


def data_digest(*tensors: torch.Tensor) -> str:
    """sha256 of the tensors' shapes and bytes (the tokenised pairs)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(repr(tuple(t.shape)).encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_reference(path: Path, tensors: dict[str, torch.Tensor], *, digest: str) -> None:
    """Write `tensors` to `path` atomically, with the data digest in the metadata."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    try:
        save_file(
            {k: v.detach().contiguous() for k, v in tensors.items()},
            str(tmp),
            # one key: safetensors writes a metadata map in no fixed order
            metadata={"digest": digest},
        )
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def read_reference(path: Path) -> tuple[dict[str, torch.Tensor], str] | None:
    """The stored tensors and their data digest; None when there is no file."""
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    return tensors, meta.get("digest", "")
