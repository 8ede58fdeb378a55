"""LoRA adapters in peft's file format: their state dict, adapter folders, merged exports.

peft's saved keys are the module path under `base_model.model.`:

    <module path>.lora_A.weight  <->  base_model.model.<module path>.lora_A.weight

`save_adapter` writes `adapter_config.json` + `adapter_model.safetensors`, which
`peft.PeftModel.from_pretrained(base, path)` loads; `load_adapter_state_dict` reads the
same keys back; `save_merged` writes the model with the adapters folded in, in Hugging
Face's layout. Values are the latest ones: RoundPipe's optimizer-side masters where there
are some, after the pending optimizer steps.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from ..attribute import ParamAttribute
from ..errors import ConfigError
from ..memory import packed_form
from ..optim_stream import synchronize_optim
from .lora import LoraLinear, lora_config_of, lora_modules, unwrap, user_model

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "adapter_state_dict",
    "load_adapter_state_dict",
    "save_adapter",
    "save_merged",
]

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
# peft's saved keys are relative to PeftModel -> LoraModel -> the base model.
_PEFT_PREFIX = "base_model.model."
# Merged exports are written in shards of at most this many bytes (HF's sharded layout),
# so a 32B model is never copied whole in host memory.
_SHARD_BYTES = 4 * 2**30


def _latest(p: nn.Parameter) -> Tensor:
    """A parameter's newest value: the optimizer-side master when RoundPipe has one."""
    if ParamAttribute.has(p):
        optim = ParamAttribute.get(p).optim
        if optim is not None:
            return optim.detach()
    return p.detach()


def adapter_state_dict(model_or_rp: nn.Module) -> dict[str, Tensor]:
    """The adapters' weights under peft's saved key names, fp32 copies of the latest values.

    Waits for pending optimizer steps first, so an asynchronous step is included.
    """
    synchronize_optim()
    out: dict[str, Tensor] = {}
    for name, mod in lora_modules(model_or_rp):
        for part in ("lora_A", "lora_B"):
            w = getattr(mod, part).weight
            out[f"{_PEFT_PREFIX}{name}.{part}.weight"] = _latest(w).to(
                "cpu", torch.float32, copy=True
            )
    if not out:
        raise ConfigError("the model has no LoRA adapters; apply_lora (or lora_config=) first")
    return out


def _normalise_key(key: str) -> str:
    # peft's in-memory names carry the adapter name ("lora_A.default.weight"); files do not.
    key = key.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
    return key if key.startswith(_PEFT_PREFIX) else _PEFT_PREFIX + key


def load_adapter_state_dict(model_or_rp: nn.Module, state: Mapping[str, Tensor]) -> None:
    """Set the adapters from `state` (peft key names; with or without the
    'base_model.model.' prefix), in the model and in RoundPipe's optimizer-side copies.

    Raises:
        ConfigError: Keys missing or unexpected, or a shape that does not fit.
    """
    synchronize_optim()
    given = {_normalise_key(k): v for k, v in state.items()}
    params: dict[str, nn.Parameter] = {}
    for name, mod in lora_modules(model_or_rp):
        for part in ("lora_A", "lora_B"):
            params[f"{_PEFT_PREFIX}{name}.{part}.weight"] = getattr(mod, part).weight
    if not params:
        raise ConfigError("the model has no LoRA adapters; apply_lora (or lora_config=) first")
    missing, unexpected = sorted(params.keys() - given.keys()), sorted(given.keys() - params.keys())
    if missing or unexpected:
        raise ConfigError(
            f"adapter state does not fit the model: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''} (was it saved for another model or "
            "other target_modules?)"
        )
    for key, p in params.items():
        value = given[key]
        if tuple(value.shape) != tuple(p.shape):
            raise ConfigError(
                f"adapter weight {key} has shape {tuple(value.shape)}, the model's is "
                f"{tuple(p.shape)} (another rank?)"
            )
    with torch.no_grad():
        for key, p in params.items():
            value = given[key]
            p.data.copy_(value)
            if ParamAttribute.has(p) and ParamAttribute.get(p).optim is not None:
                ParamAttribute.get(p).optim.data.copy_(value)


# ---- files -------------------------------------------------------------------------------


def _task_type(root: nn.Module) -> str | None:
    return "CAUSAL_LM" if type(root).__name__.endswith("ForCausalLM") else None


def save_adapter(
    model_or_rp: nn.Module,
    path: str | os.PathLike[str],
    *,
    merged_path: str | os.PathLike[str] | None = None,
) -> None:
    """Write the adapter in peft's format (adapter_config.json + adapter_model.safetensors).

    `peft.PeftModel.from_pretrained(base_model, path)` loads it onto the base model.
    With `merged_path`, also write the model with the adapters folded into its weights, as
    a plain model: for a Hugging Face model its config and safetensors weights (what
    `AutoModelForCausalLM.from_pretrained` loads), else the safetensors weights.
    """
    from safetensors.torch import save_file

    cfg = lora_config_of(model_or_rp)
    state = adapter_state_dict(model_or_rp)
    root = user_model(model_or_rp)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = getattr(root, "config", None)
    base_name = getattr(config, "_name_or_path", None) or None
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / ADAPTER_WEIGHTS_NAME))
    (out / ADAPTER_CONFIG_NAME).write_text(
        json.dumps(cfg.to_peft_json(base_name, _task_type(root)), indent=2) + "\n"
    )
    if merged_path is not None:
        save_merged(model_or_rp, merged_path)


def _merged_tensors(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, int, Tensor]]:
    """(key, id of the model's tensor, value) of the model's state dict as it would be
    without adapters (adapted weights merged), walked through RoundPipe wrappers; a tied
    tensor comes under each of its names with the same id (the caller drops repeats)."""
    inner = unwrap(module)
    if inner is not None:
        yield from _merged_tensors(inner[0], prefix)
        return
    dot = f"{prefix}." if prefix else ""
    if isinstance(module, LoraLinear):
        base = module.base_layer
        yield (
            f"{dot}weight",
            id(base.weight),
            module.merged_weight(_latest(module.lora_A.weight), _latest(module.lora_B.weight)),
        )
        if base.bias is not None:
            yield f"{dot}bias", id(base.bias), base.bias.detach()
        return
    for name, p in module._parameters.items():
        if p is not None:
            # an NF4 weight no adapter covers: decoded (its own storage is a NaN stand-in)
            packed = packed_form(p)
            yield f"{dot}{name}", id(p), p.detach() if packed is None else packed.dequantize()
    for name, b in module._buffers.items():
        if b is not None and name not in module._non_persistent_buffers_set:
            yield f"{dot}{name}", id(b), b.detach()
    for name, child in module._modules.items():
        if child is not None:
            yield from _merged_tensors(child, f"{dot}{name}")


def save_merged(model_or_rp: nn.Module, path: str | os.PathLike[str]) -> None:
    """Write the model with its adapters folded in: Hugging Face's layout (config.json,
    generation_config.json, model.safetensors, or shards of <= 4 GiB with an index), one
    shard in memory at a time. A tied weight is written once, under its first name."""
    from safetensors.torch import save_file

    synchronize_optim()
    root = user_model(model_or_rp)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[list[str]] = []  # keys of each written shard
    current: dict[str, Tensor] = {}
    size = 0
    seen: set[int] = set()

    def flush() -> None:
        save_file(current, str(out / f"shard-{len(shards)}.tmp"), metadata={"format": "pt"})
        shards.append(list(current))
        current.clear()

    for key, ident, tensor in _merged_tensors(root):
        if ident in seen:  # the model's tensors live on: their ids are not reused
            continue
        seen.add(ident)
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > _SHARD_BYTES:
            flush()
            size = 0
        current[key] = tensor.to("cpu").contiguous()
        size += nbytes
    flush()
    if len(shards) == 1:
        (out / "shard-0.tmp").rename(out / "model.safetensors")
    else:
        weight_map: dict[str, str] = {}
        for i, keys in enumerate(shards):
            final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            (out / f"shard-{i}.tmp").rename(out / final)
            weight_map.update(dict.fromkeys(keys, final))
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    for attr in ("config", "generation_config"):
        obj = getattr(root, attr, None)
        if obj is not None and hasattr(obj, "save_pretrained"):
            obj.save_pretrained(out)
