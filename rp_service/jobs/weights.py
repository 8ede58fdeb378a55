"""Whether a local model folder's safetensors weights cover the model, from their headers.

At submission, before anything is allocated: a folder missing tensors would otherwise
train (and serve) on randomly initialised weights, with only a table of MISSING weights in
the worker log. Only each file's JSON header is read (8 bytes of length, then the header),
never a tensor; torch-free, as the daemon's request path must be.

The names checked are the ones every family of `engine.catalog` shares (Hugging Face's
layout): the embedding, each decoder layer's attention projections, the dense families'
MLP projections, and the output head unless it is tied to the embedding. Norms and biases
are not listed: a folder that has every projection but lacks those is not what this guards.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.catalog import FAMILIES
from rp_service.errors import InvalidRequest

__all__ = [
    "check_weights_cover",
    "expected_tensor_names",
    "safetensors_header",
    "safetensors_names",
    "safetensors_numel",
]

_MAX_HEADER_BYTES = 100 << 20  # the format's own limit on a header
_NAMED_MISSING = 5  # names given in the message; details carry the count
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def safetensors_names(path: Path) -> set[str]:
    """The tensor names in one .safetensors file's header. Raises ValueError when the
    file is not a safetensors file (short, a header too long or not a JSON object)."""
    return set(safetensors_header(path))


def safetensors_header(path: Path) -> dict[str, Any]:
    """Tensor name -> its header entry (`dtype`, `shape`, `data_offsets`), without
    `__metadata__`. Raises ValueError as `safetensors_names`."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("shorter than a safetensors header")
        (size,) = struct.unpack("<Q", head)
        if size > _MAX_HEADER_BYTES:
            raise ValueError(f"a header of {size} bytes (at most {_MAX_HEADER_BYTES})")
        header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    return {name: entry for name, entry in header.items() if name != "__metadata__"}


def safetensors_numel(folder: Path) -> int | None:
    """Elements of every tensor in the folder's *.safetensors files (headers only); None
    when there is none, or one cannot be read."""
    files = sorted(folder.glob("*.safetensors"))
    total = 0
    try:
        for file in files:
            for entry in safetensors_header(file).values():
                shape = entry.get("shape") if isinstance(entry, dict) else None
                if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
                    return None
                total += math.prod(shape)
    except (OSError, ValueError, RecursionError):
        return None
    return total if files else None


def _positive_int(value: Any) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return value if ok else None


def expected_tensor_names(config: Mapping[str, Any]) -> set[str] | None:
    """The tensor names (without the `model.` prefix of the decoder) a folder of this
    config.json must hold; None when the family or the layer count is not known here."""
    family = FAMILIES.get(str(config.get("model_type")))
    layers = _positive_int(config.get("num_hidden_layers"))
    if family is None or layers is None:
        return None
    modules = [f"self_attn.{m}" for m in _ATTENTION]
    if family.plannable:  # the dense families; the MoE ones hold experts instead
        modules += [f"mlp.{m}" for m in _MLP]
    names = {"embed_tokens.weight"}
    names |= {f"layers.{i}.{m}.weight" for i in range(layers) for m in modules}
    # The dense families default to an untied head; a tied head is the embedding itself.
    if config.get("tie_word_embeddings", False) is False:
        names.add("lm_head.weight")
    return names


def check_weights_cover(folder: Path, config: Mapping[str, Any], *, param: str) -> None:
    """Raise InvalidRequest (`invalid_model`) when the folder's *.safetensors files lack
    tensors the model needs, naming a few and the count. A folder without any safetensors
    file, or a config this module cannot read the layout of, is left to the worker."""
    files = sorted(folder.glob("*.safetensors"))
    expected = expected_tensor_names(config)
    if not files or expected is None:
        return
    present: set[str] = set()
    for file in files:
        try:
            names = safetensors_names(file)
        except (OSError, ValueError, RecursionError) as exc:
            raise InvalidRequest(
                f"{param}: {file.name} is not a readable safetensors file ({exc})",
                code="invalid_model",
                param=param,
            ) from None
        # The decoder's tensors are saved as model.<name> by a CausalLM, <name> by its base.
        present |= {n.removeprefix("model.") for n in names}
    missing = sorted(expected - present, key=_natural)
    if missing:
        named = ", ".join(missing[:_NAMED_MISSING])
        more = f" and {len(missing) - _NAMED_MISSING} more" if len(missing) > _NAMED_MISSING else ""
        raise InvalidRequest(
            f"{param}: the weights in {folder} do not cover the model: {len(missing)} of "
            f"{len(expected)} tensors are missing ({named}{more}); copy the whole model "
            "folder (every *.safetensors shard)",
            code="invalid_model",
            param=param,
            details={"missing_count": len(missing), "missing": missing[:_NAMED_MISSING]},
        )


def _natural(name: str) -> tuple[Any, ...]:
    """layers.2 before layers.10."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))
