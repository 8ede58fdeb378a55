"""A finished job's output folder: the model (HF format) or the LoRA adapter, and the tokenizer.

Written into a temporary sibling, flushed and renamed into place (rp_service.durable), so
the output folder is whole or absent.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..data.tokenizer import JobTokenizer
from ..durable import replacing

__all__ = ["MERGED_DIR", "save_output"]

MERGED_DIR = "merged"  # a LoRA job's merged model, inside its adapter output folder


def save_output(
    out: Path,
    *,
    hf_model: torch.nn.Module,
    rp: Any,
    tokenizer: JobTokenizer,
    adapters: bool,
    merge: bool,
    metrics: dict[str, Any],
) -> Path:
    """Write the final model and tokenizer into `out`; return `out`.

    A full fine-tune's folder is the HF model (`save_pretrained`). A LoRA job's
    (`adapters`) is the PEFT adapter folder (adapter_config.json +
    adapter_model.safetensors), with the merged model in its ``merged/`` subdirectory when
    `merge`. `metrics` (the last step's) go to training_metrics.json.
    """
    # Whole or absent: a failure (e.g. ENOSPC) frees what was written, a finished one is
    # on disk before the job can be marked succeeded.
    with replacing(out, directory=True) as tmp:
        if not adapters:
            hf_model.save_pretrained(str(tmp), safe_serialization=True)
        else:
            merged = tmp / MERGED_DIR if merge else None
            rp.save_adapter(str(tmp), merged_path=None if merged is None else str(merged))
            if merged is not None:
                tokenizer.save(merged)
        tokenizer.save(tmp)
        (tmp / "training_metrics.json").write_text(json.dumps(metrics, indent=1))
    return out
