"""A finished job's output folder: the model (HF format) or the LoRA adapter, and the tokenizer.

Written into a temporary sibling and renamed into place, so the output folder is whole or
absent.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from ..data.tokenizer import JobTokenizer

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
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if not adapters:
            hf_model.save_pretrained(str(tmp), safe_serialization=True)
        else:
            merged = tmp / MERGED_DIR if merge else None
            rp.save_adapter(str(tmp), merged_path=None if merged is None else str(merged))
            if merged is not None:
                tokenizer.save(merged)
        tokenizer.save(tmp)
        (tmp / "training_metrics.json").write_text(json.dumps(metrics, indent=1))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # e.g. ENOSPC: free what was written
        raise
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
