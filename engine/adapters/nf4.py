"""NF4: a frozen weight kept 4-bit in host memory and decoded on the device after upload.

QLoRA's base: each frozen linear weight is stored as NormalFloat-4 codes with one fp32
absmax per block of 64 values, in bitsandbytes' layout exactly (what
`bitsandbytes.functional.quantize_4bit(w, blocksize=64, quant_type="nf4")` returns and what
transformers writes for `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`):

    packed   uint8 ((n + 1) // 2, 1): value 2i in the high nibble of byte i, 2i+1 in the low
    absmax   float32 (ceil(n / 64),): blocks run over the row-major flattened weight
    value    = NF4_CODE[nibble] * absmax[block], computed in fp32, rounded to the weight dtype

The model keeps an ordinary-looking `nn.Parameter` for such a weight (its shape, dtype,
requires_grad=False) whose storage is a single NaN broadcast to the shape (a few bytes: a
host-side use of it is loud, not plausible); the packed form hangs on it as
`param.rp_packed` (an `NF4Weight`, see `engine.memory.PACKED_ATTR`). The engine's upload
(`engine.transfer`) copies the packed bytes and the absmax and decodes them on the device
into a plain half-precision (or fp32) tensor bound to the replica's parameter, so the
compiled decoder and LoRA's merge of its adapter into the uploaded weight see what they
always see. Pinning pins the packed tensors; the memory checks count their bytes.

Decoding uses bitsandbytes' own kernel (`torch.ops.bitsandbytes.dequantize_4bit`: C on the
CPU, CUDA on GPUs, run on the caller's current stream) and falls back to a table lookup in
torch on a device it has no kernel for; both give the same bits (fp32 product, one rounding).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Container
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..errors import ConfigError
from ..memory import PACKED_ATTR, packed_form

__all__ = [
    "NF4_BLOCK",
    "NF4_CODE",
    "NF4Weight",
    "dequantize_nf4",
    "host_base_bytes",
    "packed_parameter",
    "quantize_base_nf4",
    "quantize_nf4",
    "set_dequantize_kernel",
]

log = logging.getLogger(__name__)

NF4_BLOCK = 64
# The 16 NormalFloat-4 levels (QLoRA, appendix E), as bitsandbytes stores them in fp32.
NF4_CODE = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=torch.float32,
)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
# Quantizing a big weight whole would make fp32 temporaries several times its size; rows
# are quantized in chunks of about this many values (a multiple of the block, so the
# packed bytes and absmax are those of the whole tensor).
_QUANT_CHUNK_VALUES = 1 << 24

_Kernel = Literal["auto", "bnb", "torch"]
_kernel: _Kernel = "auto"


def set_dequantize_kernel(kernel: _Kernel) -> None:
    """Choose the decoder: 'bnb' (bitsandbytes' kernel), 'torch' (table lookup in torch)
    or 'auto' (bitsandbytes where it has a kernel for the device, else torch)."""
    global _kernel
    if kernel not in ("auto", "bnb", "torch"):
        raise ConfigError(f"dequantize kernel must be 'auto', 'bnb' or 'torch', got {kernel!r}")
    _kernel = kernel


def _bnb_ops() -> Any:
    """bitsandbytes' torch ops namespace (importing bitsandbytes registers them)."""
    import bitsandbytes  # noqa: F401

    return torch.ops.bitsandbytes


@dataclass(eq=False)
class NF4Weight:
    """A weight in NF4 (bitsandbytes' layout): packed codes, absmax, logical shape, dtype."""

    packed: Tensor  # uint8 ((n + 1) // 2, 1)
    absmax: Tensor  # float32 (ceil(n / 64),)
    shape: torch.Size
    dtype: torch.dtype  # what the device decodes into (the model's dtype)

    def __post_init__(self) -> None:
        self.packed, self.absmax = _unviewed(self.packed), _unviewed(self.absmax)
        n = math.prod(self.shape)
        if self.packed.dtype != torch.uint8 or self.packed.numel() != (n + 1) // 2:
            raise ConfigError(
                f"NF4 packed codes of a {tuple(self.shape)} weight must be {(n + 1) // 2} "
                f"uint8 values, got {self.packed.numel()} {self.packed.dtype}"
            )
        if self.absmax.dtype != torch.float32 or self.absmax.numel() != -(-n // NF4_BLOCK):
            raise ConfigError(
                f"NF4 absmax of a {tuple(self.shape)} weight must be {-(-n // NF4_BLOCK)} "
                f"float32 values (one per {NF4_BLOCK}), got {self.absmax.numel()} "
                f"{self.absmax.dtype}"
            )
        if self.dtype not in _FLOATS:
            raise ConfigError(f"NF4 decodes into fp16, bf16 or fp32, not {self.dtype}")

    def tensors(self) -> list[Tensor]:
        """The host tensors that hold this weight (what pinning pins)."""
        return [self.packed, self.absmax]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def to_device(
        self, device: torch.device, *, non_blocking: bool, out: Tensor | None = None
    ) -> Tensor:
        """The decoded weight on `device` (into `out` if given): the packed codes and the
        absmax are copied there on the current stream and decoded after the copies."""
        packed, absmax = self.packed, self.absmax
        if packed.device != device:
            packed = packed.to(device, non_blocking=non_blocking)
            absmax = absmax.to(device, non_blocking=non_blocking)
        return dequantize_nf4(packed, absmax, self.shape, self.dtype, out=out)

    def dequantize(self) -> Tensor:
        """The decoded weight on the host (exports and tests; not the training path)."""
        return dequantize_nf4(self.packed, self.absmax, self.shape, self.dtype)


def _unviewed(t: Tensor) -> Tensor:
    """`t` as a tensor of its own on the same memory (no copy). A view keeps its base
    tensor alive: when pinning later moves the view's data (`t.data = pinned`), the base
    would still hold the old storage, and the host would keep every packed weight twice
    (measured on the 70B base: 103 GiB of RSS for 40 GiB of packed bytes)."""
    if t._base is None:
        return t
    own = torch.empty(0, dtype=t.dtype, device=t.device)
    return own.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


def quantize_nf4(weight: Tensor, *, dtype: torch.dtype | None = None) -> NF4Weight:
    """`weight` in NF4 with blocks of 64 (bitsandbytes' quantize_4bit, chunk by chunk).

    Args:
        dtype: What the device decodes into; default the weight's dtype.
    """
    from bitsandbytes.functional import quantize_4bit

    w = weight.detach()
    if w.dtype not in _FLOATS:
        raise ConfigError(f"NF4 quantizes fp16, bf16 or fp32 weights, not {w.dtype}")
    shape = w.shape
    flat = w.reshape(-1)  # row-major: the blocks bitsandbytes forms
    n = flat.numel()
    step = max(NF4_BLOCK, _QUANT_CHUNK_VALUES // NF4_BLOCK * NF4_BLOCK)
    packed_parts, absmax_parts = [], []
    for start in range(0, n, step):
        part, state = quantize_4bit(
            flat[start : start + step], blocksize=NF4_BLOCK, quant_type="nf4"
        )
        packed_parts.append(part.reshape(-1))
        absmax_parts.append(state.absmax.reshape(-1).float())
    packed = torch.cat(packed_parts).reshape(-1, 1) if len(packed_parts) > 1 else packed_parts[0]
    absmax = torch.cat(absmax_parts) if len(absmax_parts) > 1 else absmax_parts[0]
    return NF4Weight(packed.reshape(-1, 1), absmax, shape, dtype or w.dtype)


def dequantize_nf4(
    packed: Tensor,
    absmax: Tensor,
    shape: torch.Size | tuple[int, ...],
    dtype: torch.dtype,
    *,
    out: Tensor | None = None,
) -> Tensor:
    """Decode NF4 codes into a `shape` tensor of `dtype` on their device (into `out`)."""
    shape = torch.Size(shape)
    use_bnb = _kernel == "bnb" or (_kernel == "auto" and _bnb_has_kernel(packed.device))
    if not use_bnb:
        return _dequantize_torch(packed, absmax, shape, dtype, out)
    ops = _bnb_ops()
    if out is not None and packed.is_cuda:
        ops.dequantize_4bit.out(packed, absmax, NF4_BLOCK, "nf4", list(shape), dtype, out=out)
        return out
    res = ops.dequantize_4bit.default(packed, absmax, NF4_BLOCK, "nf4", list(shape), dtype)
    res = res.view(shape)  # its CPU kernel returns a 1-D shape as (1, n)
    if out is None:
        return res
    return out.copy_(res)


_bnb_devices: dict[str, bool] = {}


def _bnb_has_kernel(device: torch.device) -> bool:
    """Whether bitsandbytes decodes on this device type (asked once per type)."""
    kind = device.type
    if kind not in _bnb_devices:
        try:
            ops = _bnb_ops()
            probe = torch.zeros(1, 1, dtype=torch.uint8, device=device)
            ops.dequantize_4bit.default(
                probe, torch.ones(1, device=device), NF4_BLOCK, "nf4", [2], torch.float32
            )
            _bnb_devices[kind] = True
        except (ImportError, RuntimeError, NotImplementedError) as exc:
            log.warning("bitsandbytes cannot decode NF4 on %s (%s): using torch", kind, exc)
            _bnb_devices[kind] = False
    return _bnb_devices[kind]


def _dequantize_torch(
    packed: Tensor, absmax: Tensor, shape: torch.Size, dtype: torch.dtype, out: Tensor | None
) -> Tensor:
    """The table lookup: unpack the nibbles, index the code, scale by the block absmax."""
    n = math.prod(shape)
    codes = packed.reshape(-1)
    nibbles = torch.stack((codes >> 4, codes & 0xF), dim=1).reshape(-1)  # high nibble first
    blocks = absmax.numel()
    values = torch.zeros(blocks * NF4_BLOCK, dtype=torch.float32, device=packed.device)
    values[:n] = NF4_CODE.to(packed.device)[nibbles[:n].long()]
    values = (values.view(blocks, NF4_BLOCK) * absmax.view(-1, 1)).view(-1)[:n]  # fp32
    result = values.view(shape)
    if out is None:
        return result.to(dtype)
    return out.copy_(result)


def packed_parameter(weight: NF4Weight) -> nn.Parameter:
    """A frozen parameter of `weight`'s shape and dtype stored as `weight` (see the module
    docstring): its own storage is one NaN element, broadcast."""
    stand_in = torch.full((), float("nan"), dtype=weight.dtype).expand(weight.shape)
    p = nn.Parameter(stand_in, requires_grad=False)
    setattr(p, PACKED_ATTR, weight)
    return p


def _matches(name: str, patterns: Container[str]) -> bool:
    parts = name.split(".")
    return any(".".join(parts[i:]) in patterns for i in range(len(parts)))


def _owners(model: nn.Module) -> dict[int, int]:
    """id(parameter) -> how many (module, name) slots hold it (a tied weight: more)."""
    count: dict[int, int] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                count[id(p)] = count.get(id(p), 0) + 1
    return count


def quantize_base_nf4(model: nn.Module, *, skip_modules: Container[str] = ("lm_head",)) -> int:
    """Store the weight of every `nn.Linear` of `model` in NF4, in place; return the packed
    bytes. Apply before `wrap_model_to_roundpipe` (with or after `apply_lora`).

    Each weight is quantized and its full-precision storage dropped before the next, so
    host memory peaks at the model's own plus one weight's temporaries. Quantized weights
    are frozen (requires_grad False); biases stay as they are.

    Args:
        skip_modules: Module names kept in full precision (transformers' default for
            bitsandbytes 4-bit: the output head); a linear matches when its name or a
            dotted suffix of it is listed. A weight tied to another module (an embedding)
            is never quantized.

    Raises:
        ConfigError: The model is already wrapped, or a weight is not on the CPU.
    """
    from ..roundpipe import RoundPipeBase

    if isinstance(model, RoundPipeBase):
        raise ConfigError("quantize_base_nf4 takes the model before wrap_model_to_roundpipe")
    owners = _owners(model)
    total = 0
    count = 0
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or _matches(name, skip_modules):
            continue
        w = module.weight
        if packed_form(w) is not None:
            total += packed_form(w).nbytes
            continue
        if owners.get(id(w), 0) > 1:
            log.info("NF4: %s shares its weight with another module; kept as is", name)
            continue
        if w.device.type != "cpu":
            raise ConfigError(
                f"quantize_base_nf4: {name}.weight is on {w.device}; load the model on the CPU"
            )
        nf4 = quantize_nf4(w)
        module.weight = packed_parameter(nf4)
        total += nf4.nbytes
        count += 1
    log.info("NF4: %d linear weights quantized, %d packed bytes", count, total)
    return total


def host_base_bytes(model: nn.Module) -> int:
    """Bytes the host holds for `model`'s parameters and buffers, as stored: a packed
    weight counts its codes and absmax, anything else its own storage."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        packed = packed_form(t)
        if packed is not None:
            total += packed.nbytes
        total += t.untyped_storage().nbytes()
    return total
