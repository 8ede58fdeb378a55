"""A finished job's model as a GGUF file and an Ollama Modelfile beside it.

The model written is the one the job trained, as serving answers with it: a full
fine-tune's output folder; a LoRA job's adapter merged into its base (the job's own
``merged/`` folder when `lora.merge` wrote one, else peft's merge onto the base loaded as
serving loads it). An NF4 (QLoRA) base is first rounded through NF4 and decoded, so the
merge adds the adapter to the weights it was trained against, as the engine's own merge
does. The tokenizer, and its chat template, are the job output's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from .gguf_file import ExportError, GgufType, write_gguf

__all__ = ["MODELFILE", "export_job", "modelfile_text"]

log = logging.getLogger(__name__)

MODELFILE = "Modelfile"
_MERGED_DIR = "merged"  # rp_service.worker.output.MERGED_DIR (no worker import here)
_ADAPTER_CONFIG = "adapter_config.json"

# Ollama's TEMPLATE is a Go template, not Jinja: ChatML is spelled out; for another template
# Ollama reads the Jinja one in the GGUF's metadata and matches it to its known templates.
_CHATML_GO = (
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
    "<|im_start|>assistant\n"
)


def _decode_nf4(model: torch.nn.Module) -> None:
    """Round every linear weight the engine keeps in NF4 through NF4 and back, in place."""
    from engine.adapters.nf4 import quantize_nf4

    tied = {id(p) for n, p in model.named_parameters() if "embed" in n}
    for name, module in model.named_modules():
        if type(module) is not torch.nn.Linear or name.endswith("lm_head"):
            continue
        if id(module.weight) in tied:
            continue
        module.weight.data.copy_(quantize_nf4(module.weight.data).dequantize())


def _load(output: Path, spec: dict[str, Any]) -> tuple[torch.nn.Module, Path]:
    """The trained model in float32 on the CPU, and the folder of its tokenizer."""
    from transformers import AutoModelForCausalLM

    if not (output / _ADAPTER_CONFIG).is_file():
        return AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32), output
    merged = output / _MERGED_DIR
    if (merged / "config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32), output
    from peft import PeftModel

    from rp_service.serving.models import BaseModel
    from rp_service.serving.process import _load_base

    model_spec = spec.get("model", {})
    if model_spec.get("path"):
        base_spec = BaseModel(path=model_spec["path"])
    else:
        base_spec = BaseModel(
            preset=model_spec["preset"],
            config=dict(model_spec.get("config") or {}),
            seed=int(spec.get("train", {}).get("seed", 0)),
            tokenizer=str(output),
        )
    base = _load_base(base_spec, device="cpu", dtype=torch.float32)
    if model_spec.get("quantization") == "nf4":
        _decode_nf4(base)
    return PeftModel.from_pretrained(base, str(output)).merge_and_unload(), output


def modelfile_text(gguf_name: str, tokenizer: Any) -> str:
    """An Ollama Modelfile for `gguf_name` (beside it): the file, its stop tokens, and the
    chat template spelled in Go when it is ChatML."""
    template = tokenizer.chat_template or ""
    lines = [f"FROM ./{gguf_name}"]
    if "<|im_start|>" in template:
        lines.append(f'TEMPLATE """{_CHATML_GO}"""')
        lines.append('PARAMETER stop "<|im_end|>"')
    if tokenizer.eos_token:
        lines.append(f"PARAMETER stop {json.dumps(tokenizer.eos_token)}")
    return "\n".join(lines) + "\n"


def export_job(
    output: str | Path, spec: dict[str, Any], *, kind: GgufType, dest: str | Path, name: str
) -> dict[str, Any]:
    """Write `<dest>/<name>-<kind>.gguf` and `<dest>/Modelfile`; return their paths and
    the GGUF's size.

    Raises:
        ExportError: the job's model is something llama.cpp cannot load.
    """
    from transformers import AutoTokenizer

    output, dest = Path(output), Path(dest)
    if not output.is_dir():
        raise ExportError(f"the job's output folder {str(output)!r} is gone")
    model, tokenizer_dir = _load(output, spec)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    dest.mkdir(parents=True, exist_ok=True)
    gguf_path = dest / f"{name}-{kind}.gguf"
    partial = gguf_path.with_name(gguf_path.name + ".partial")
    try:
        write_gguf(model, tokenizer, tokenizer_dir, partial, kind=kind, name=name)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.replace(gguf_path)  # whole or absent
    modelfile = dest / MODELFILE
    modelfile.write_text(modelfile_text(gguf_path.name, tokenizer))
    return {"path": str(gguf_path), "modelfile": str(modelfile), "bytes": gguf_path.stat().st_size}
