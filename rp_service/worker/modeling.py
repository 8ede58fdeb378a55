"""Build the Hugging Face model a job trains: a randomly initialised preset or a local directory.

Presets map to transformers classes (``qwen3`` -> Qwen3Config / Qwen3ForCausalLM, ``llama``
-> LlamaConfig / LlamaForCausalLM, and ``qwen2``, ``mistral``, ``qwen3_moe``, ``gpt_oss``),
the families of `engine.catalog.FAMILIES`, which the engine has sequential presets for; the
spec's ``model.config`` overrides the config's defaults. A local directory must hold a
``config.json`` of one of those model types and ``*.safetensors`` weights.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from engine.catalog import FAMILIES, PRESET_NAMES

from ..errors import JobFailure

__all__ = [
    "DTYPES",
    "ModelError",
    "build_model",
]

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_VOCAB_MULTIPLE = 8  # embedding rows a preset's vocabulary is rounded up to


class ModelError(JobFailure, ValueError):
    """The model section cannot be built; `param` names the spec field to change."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__("invalid_model", message, param=param)


def _classes(model_type: str) -> tuple[Any, Any]:
    import transformers

    family = FAMILIES[model_type]
    return getattr(transformers, family.config_class), getattr(transformers, family.model_class)


def _preset_config(preset: str, overrides: dict[str, Any], vocab_size: int) -> Any:
    config_cls, _ = _classes(preset)
    fields = dict(overrides)
    if "vocab_size" not in fields:
        fields["vocab_size"] = -(-vocab_size // _VOCAB_MULTIPLE) * _VOCAB_MULTIPLE
    try:
        config = config_cls(**fields)
    except (TypeError, ValueError) as exc:
        raise ModelError(
            f"model.config is not a valid {preset} config: {exc}", param="model.config"
        ) from exc
    if config.vocab_size < vocab_size:
        raise ModelError(
            f"model.config.vocab_size is {config.vocab_size} but the tokenizer has {vocab_size} "
            f"ids; set it to at least {vocab_size} or leave it out",
            param="model.config.vocab_size",
        )
    return config


def _check_dir(path: Path) -> None:
    if not path.is_dir():
        raise ModelError(f"model directory {str(path)!r} does not exist", param="model.path")
    if not (path / "config.json").is_file():
        raise ModelError(
            f"model directory {str(path)!r} has no config.json; give a Hugging Face model "
            "directory (config.json + *.safetensors)",
            param="model.path",
        )
    if not any(path.glob("*.safetensors")):
        raise ModelError(
            f"model directory {str(path)!r} has no *.safetensors weights; convert .bin "
            "weights with transformers' save_pretrained(safe_serialization=True)",
            param="model.path",
        )


def build_model(
    *,
    preset: str | None,
    config_overrides: dict[str, Any],
    path: str | Path | None,
    dtype: str,
    vocab_size: int,
    seed: int,
    quantization: str = "none",
) -> torch.nn.Module:
    """Return the HF causal LM of a job, in `dtype`, in training mode, without KV cache.

    Args:
        preset: an `engine.catalog.PRESET_NAMES` name for a randomly initialised model (seeded by `seed`).
        config_overrides: HF config fields for a preset.
        path: a local HF model directory instead of a preset.
        vocab_size: ids of the job's tokenizer; the embedding must cover them.
        quantization: 'nf4': the linear weights (not the output head) held 4-bit
            (engine.adapters.nf4): a preset is built then quantized in place; a directory
            is read tensor by tensor, quantized as it loads (a bitsandbytes 4-bit folder
            as saved), never whole in full precision.

    Raises:
        ModelError: the directory is unusable or the config is invalid.
    """
    torch_dtype = DTYPES[dtype]
    if preset is not None:
        if preset not in FAMILIES:
            raise ModelError(
                f"unknown model.preset {preset!r}; use one of {sorted(PRESET_NAMES)}",
                param="model.preset",
            )
        config = _preset_config(preset, config_overrides, vocab_size)
        config.use_cache = False
        _, model_cls = _classes(preset)
        torch.manual_seed(seed)  # the random init is part of the job's reproducible state
        model = model_cls(config).to(torch_dtype)
        if quantization == "nf4":
            from engine.adapters.nf4 import quantize_base_nf4

            quantize_base_nf4(model)  # draws no random numbers: the adapters' init is unchanged
    else:
        if path is None:
            raise ModelError("give model.preset or model.path", param="model")
        directory = Path(path)
        _check_dir(directory)
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            config = AutoConfig.from_pretrained(str(directory))
        except Exception as exc:  # transformers raises many types; all mean "unreadable"
            raise ModelError(
                f"cannot read {directory / 'config.json'}: {exc}", param="model.path"
            ) from exc
        if config.model_type not in FAMILIES:
            raise ModelError(
                f"model type {config.model_type!r} has no RoundPipe preset; supported: "
                f"{sorted(PRESET_NAMES)}",
                param="model.path",
            )
        if config.vocab_size < vocab_size:
            raise ModelError(
                f"the model's vocab_size {config.vocab_size} is smaller than the tokenizer's "
                f"{vocab_size} ids; give the model's own tokenizer (tokenizer.path)",
                param="tokenizer.path",
            )
        try:
            if quantization == "nf4":
                from engine.adapters.quantized_load import load_nf4_model

                model = load_nf4_model(directory, dtype=torch_dtype)
            else:
                model = AutoModelForCausalLM.from_pretrained(
                    str(directory), dtype=torch_dtype, use_safetensors=True
                )
        except Exception as exc:
            raise ModelError(
                f"cannot load the weights in {str(directory)!r}: {exc}", param="model.path"
            ) from exc
        model.config.use_cache = False
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log.info(
        "model %s: %d parameters, %s, quantization %s",
        model.config.model_type,
        n_params,
        dtype,
        quantization,
    )
    return model
