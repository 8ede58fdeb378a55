"""Load a Hugging Face folder with its linear weights in NF4, one tensor at a time.

`load_nf4_model(path)` builds the model with its parameters on the meta device (buffers
such as the rotary tables are computed as usual, on the CPU), then reads the folder's
safetensors tensor by tensor:

- a bf16/fp16/fp32 folder: each linear weight (but `skip_modules`) is quantized to NF4 as
  it is read (engine.adapters.nf4.quantize_nf4) and only its packed form kept, so host
  memory peaks at the final footprint plus one tensor in full precision (and the fp32
  temporaries of one chunk of 16M values);
- a folder saved 4-bit by transformers (config.json `quantization_config` with
  `quant_method: bitsandbytes`, `load_in_4bit`, `bnb_4bit_quant_type: nf4`): each weight
  comes as `<name>.weight` (packed uint8), `<name>.weight.absmax`, `<name>.weight.quant_map`
  and `<name>.weight.quant_state.bitsandbytes__nf4` (a JSON blob: shape, dtype, blocksize);
  the packed bytes are used as they are, never re-quantized. A double-quantized absmax
  (`bnb_4bit_use_double_quant`: `nested_absmax`, `nested_quant_map`) is decoded to fp32
  once at load with bitsandbytes' own op (the absmax only, 1/64 of the values).

The result is an ordinary HF model whose quantized weights are packed parameters; apply
LoRA and wrap it as usual (`wrap_model_to_roundpipe(model, lora_config=...)`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Container, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from .nf4 import NF4_BLOCK, NF4Weight, _matches, packed_parameter, quantize_nf4

__all__ = ["load_nf4_model"]

log = logging.getLogger(__name__)

# Tensors of a bitsandbytes 4-bit weight besides the packed codes, by suffix.
_QUANT_SUFFIXES = (
    ".absmax",
    ".quant_map",
    ".nested_absmax",
    ".nested_quant_map",
    ".quant_state.bitsandbytes__nf4",
    ".quant_state.bitsandbytes__fp4",
)
_STATE_KEY = ".quant_state.bitsandbytes__nf4"


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device (buffers stay real)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _shard_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    if single.exists():
        return [single]
    raise ConfigError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def _bnb_4bit(config: Any) -> bool:
    """Whether `config` says the weights are saved 4-bit NF4 by bitsandbytes (and refuse
    another quantization)."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return False
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    if qc.get("quant_method") != "bitsandbytes" or not qc.get("load_in_4bit"):
        raise ConfigError(
            f"quantization_config {qc.get('quant_method')!r} is not supported; the engine "
            "loads bitsandbytes 4-bit NF4 folders (BitsAndBytesConfig(load_in_4bit=True, "
            "bnb_4bit_quant_type='nf4')) or unquantized ones"
        )
    if qc.get("bnb_4bit_quant_type") != "nf4":
        raise ConfigError(
            f"bnb_4bit_quant_type {qc.get('bnb_4bit_quant_type')!r} is not supported; "
            "the engine's 4-bit base is NF4"
        )
    return True


def _quant_state(raw: torch.Tensor) -> dict[str, Any]:
    """The JSON blob bitsandbytes packs into a uint8 tensor (shape, dtype, blocksize...)."""
    return json.loads(bytes(raw.tolist()).decode("utf-8"))


def _saved_nf4(name: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> NF4Weight:
    """The NF4Weight of a weight saved by bitsandbytes (its tensors by full key)."""
    state = _quant_state(tensors[name + _STATE_KEY])
    if state.get("quant_type") != "nf4" or int(state.get("blocksize", 0)) != NF4_BLOCK:
        raise ConfigError(
            f"{name}: saved as {state.get('quant_type')} with blocksize "
            f"{state.get('blocksize')}; the engine reads NF4 with blocksize {NF4_BLOCK}"
        )
    absmax = tensors[name + ".absmax"]
    if name + ".nested_absmax" in tensors:
        from bitsandbytes.functional import QuantState, dequantize_blockwise

        nested = QuantState(
            absmax=tensors[name + ".nested_absmax"],
            code=tensors[name + ".nested_quant_map"],
            blocksize=int(state["nested_blocksize"]),
            dtype=getattr(torch, state["nested_dtype"]),
        )
        absmax = dequantize_blockwise(absmax, nested) + float(state["nested_offset"])
    packed = tensors[name].reshape(-1, 1)
    if packed.dtype != torch.uint8:
        packed = packed.view(torch.uint8)  # bnb_4bit_quant_storage of another width
    return NF4Weight(packed, absmax.float().reshape(-1), torch.Size(state["shape"]), dtype)


def load_nf4_model(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    skip_modules: Container[str] = ("lm_head",),
    model_class: Any = None,
) -> nn.Module:
    """A causal LM from an HF folder with its linear weights in NF4 (see the module doc).

    Args:
        dtype: The model's dtype (what NF4 decodes into on the device, and the other
            tensors' dtype); default the config's `torch_dtype`/`dtype`, else bfloat16.
        skip_modules: Linear modules kept in full precision when quantizing at load
            (a 4-bit folder keeps what it was saved with).
        model_class: The class to build (default transformers.AutoModelForCausalLM).

    Raises:
        ConfigError: Not a safetensors folder, a quantization other than bitsandbytes
            NF4, or tensors missing from / unexpected in the folder.
    """
    import transformers
    from safetensors import safe_open

    folder = Path(path)
    config = transformers.AutoConfig.from_pretrained(folder)
    saved_4bit = _bnb_4bit(config)
    if saved_4bit:
        del config.quantization_config  # we place the packed bytes ourselves
    if dtype is None:
        stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        dtype = getattr(torch, stored) if isinstance(stored, str) else stored or torch.bfloat16
    cls = model_class or transformers.AutoModelForCausalLM
    with _parameters_on_meta():
        model = cls.from_config(config, dtype=dtype)
    slots: dict[str, list[tuple[nn.Module, str]]] = {}
    by_id: dict[int, str] = {}
    for mod_name, module in model.named_modules():
        for pname, p in module._parameters.items():
            if p is None:
                continue
            key = f"{mod_name}.{pname}" if mod_name else pname
            first = by_id.setdefault(id(p), key)  # a tied parameter: every slot, one value
            slots.setdefault(first, []).append((module, pname))
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in _shard_files(folder):
        with safe_open(str(file), framework="pt") as f:
            keys = list(f.keys())
            quant_parts = {k for k in keys if k.endswith(_QUANT_SUFFIXES)}
            for key in keys:
                if key in quant_parts:
                    continue
                if key not in slots:
                    if _set_buffer(model, key, f.get_tensor(key), dtype):
                        continue
                    unexpected.append(key)
                    continue
                owner = key.rpartition(".")[0]
                if saved_4bit and key + _STATE_KEY in quant_parts:
                    parts = {k: f.get_tensor(k) for k in quant_parts if k.startswith(key + ".")}
                    parts[key] = f.get_tensor(key)
                    value = packed_parameter(_saved_nf4(key, parts, dtype))
                elif (
                    key.endswith(".weight")
                    and type(modules.get(owner)) is nn.Linear
                    and not _matches(owner, skip_modules)
                    and len(slots[key]) == 1
                ):
                    value = packed_parameter(quantize_nf4(f.get_tensor(key), dtype=dtype))
                else:
                    value = nn.Parameter(f.get_tensor(key).to(dtype), requires_grad=True)
                for module, pname in slots[key]:
                    module._parameters[pname] = value
                loaded.add(key)
    missing = sorted(set(slots) - loaded)
    if missing or unexpected:
        raise ConfigError(
            f"{folder}: the weights do not fit {type(model).__name__}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    log.info("loaded %s with an NF4 base (%s)", folder, "as saved" if saved_4bit else "quantized")
    return model.train()


def _set_buffer(model: nn.Module, key: str, value: torch.Tensor, dtype: torch.dtype) -> bool:
    """Copy a persistent buffer from the file; False when `key` names none."""
    owner, _, name = key.rpartition(".")
    try:
        module = model.get_submodule(owner) if owner else model
    except AttributeError:
        return False
    buf = module._buffers.get(name)
    if buf is None:
        return False
    module._buffers[name] = value.to(buf.dtype if not buf.is_floating_point() else dtype)
    return True
