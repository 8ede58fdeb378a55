"""Full checkpoints of a RoundPipe's fp32 masters and optimizer state, for any number of ranks.

`save_checkpoint` writes one file from rank 0 (data parallel: gathered from every rank's
shard), keyed by parameter name; `load_checkpoint` loads it on any number of ranks, one
included, each keeping its own rows (engine.parallel.data_parallel's shard layout).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from ..optim_stream import synchronize_optim

if TYPE_CHECKING:
    from ..roundpipe import RoundPipeBase
    from .data_parallel import DataParallel

__all__ = ["CHECKPOINT_FORMAT", "load_checkpoint", "save_checkpoint"]

CHECKPOINT_FORMAT = "roundpipe-full/1"


@dataclass(slots=True)
class _Piece:
    """One optimizer-side tensor of this rank and where it lies in its full parameter."""

    name: str
    tensor: nn.Parameter
    start: int  # in the full parameter's flat view
    stop: int
    full_shape: tuple[int, ...]


def _local_pieces(model: RoundPipeBase) -> list[_Piece]:
    dp: DataParallel | None = getattr(model, "_dp", None)
    if dp is None:
        return [
            _Piece(n, t, 0, t.numel(), tuple(t.shape)) for n, t in model.optim_named_parameters()
        ]
    pieces = []
    for layout in dp.layouts:
        for span in layout.mine:
            p, pa, name = layout.params[span.param]
            assert pa.optim is not None
            pieces.append(_Piece(name, pa.optim, span.start, span.stop, tuple(p.shape)))
    return pieces


def _is_piece_tensor(value: Any, piece: _Piece) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == piece.tensor.shape and value.dim() > 0


def save_checkpoint(
    path: str | os.PathLike[str],
    model: RoundPipeBase,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: Any = None,
) -> None:
    """Write one full checkpoint that any number of ranks can load (collective under DP).

    Rank 0 writes `path` (to a temporary name, renamed into place): the fp32 masters and
    the optimizer's state, both keyed by parameter name, its param groups (parameter
    names, in model order) and `extra` (plain Python values, e.g. the step). Other ranks
    return once the file is in place. Waits for every queued step first.
    """
    synchronize_optim()
    dp: DataParallel | None = getattr(model, "_dp", None)
    pieces = _local_pieces(model)
    by_id = {id(pc.tensor): pc for pc in pieces}
    opt_state = optimizer.state if optimizer is not None else {}
    masters: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, Any]] = {}
    # Values that are not per-element (Adam's step): taken from the piece at row 0.
    scalars: dict[str, dict[str, Any]] = {}
    tensor_keys = sorted(
        {
            k
            for pc in pieces
            for k, v in opt_state.get(pc.tensor, {}).items()
            if _is_piece_tensor(v, pc)
        }
    )
    for pc in pieces:
        if pc.start == 0 and pc.tensor in opt_state:
            scalars[pc.name] = {
                k: v for k, v in opt_state[pc.tensor].items() if not _is_piece_tensor(v, pc)
            }
    groups = [
        [by_id[id(t)].name for t in g["params"] if id(t) in by_id]
        for g in (optimizer.param_groups if optimizer is not None else [])
    ]
    if dp is None:
        for pc in pieces:
            masters[pc.name] = pc.tensor.detach().float().clone()
            if pc.tensor in opt_state:
                states[pc.name] = {
                    k: opt_state[pc.tensor][k].clone()
                    for k in tensor_keys
                    if k in opt_state[pc.tensor]
                }
    else:
        everyone: list[Any] = [None] * dp.world
        with dp._guard("the checkpoint metadata gather"):
            dist.all_gather_object(everyone, (tensor_keys, scalars, groups), group=dp.control)
        tensor_keys = sorted({k for keys, _, _ in everyone for k in keys})
        scalars = {n: v for _, s, _ in everyone for n, v in s.items()}
        order = {name: i for i, (name, _) in enumerate(nn.Module.named_parameters(model))}
        groups = [
            sorted({n for _, _, gs in everyone for n in gs[g]}, key=order.__getitem__)
            for g in range(len(groups))
        ]
        for layout in dp.layouts:
            full = dp._gather_full(layout, lambda span, pa: pa.optim)
            per_key = {
                k: dp._gather_full(layout, lambda span, pa, k=k: opt_state.get(pa.optim, {}).get(k))
                for k in tensor_keys
            }
            if dp.rank != 0:
                continue
            for i, (_, _, name) in enumerate(layout.params):
                masters[name] = full[i]  # type: ignore[assignment]
                if name in scalars:
                    states[name] = {k: v[i] for k, v in per_key.items() if v[i] is not None}
    if dp is not None and dp.rank != 0:
        dp.barrier()
        return
    for name, entry in scalars.items():
        states.setdefault(name, {}).update(entry)
    hyper = [
        {k: v for k, v in g.items() if k != "params"}
        for g in (optimizer.param_groups if optimizer is not None else [])
    ]
    checkpoint = {
        "format": CHECKPOINT_FORMAT,
        "world_size": 1 if dp is None else dp.world,
        "masters": masters,
        "optimizer": None
        if optimizer is None
        else {
            "state": states,
            "param_groups": [
                {**h, "params": names} for h, names in zip(hyper, groups, strict=True)
            ],
        },
        "extra": extra,
    }
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    torch.save(checkpoint, tmp)
    os.replace(tmp, target)
    if dp is not None:
        dp.barrier()


def load_checkpoint(
    path: str | os.PathLike[str],
    model: RoundPipeBase,
    optimizer: torch.optim.Optimizer | None = None,
) -> Any:
    """Load a `save_checkpoint` file, whatever number of ranks wrote it; returns its extra.

    Every rank reads the file and keeps its own rows of each master and optimizer state;
    the model's parameters are then set from the masters on every rank.
    """
    synchronize_optim()
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(f"{path} is not a RoundPipe checkpoint ({CHECKPOINT_FORMAT})")
    masters: dict[str, torch.Tensor] = checkpoint["masters"]
    pieces = _local_pieces(model)
    by_id = {id(pc.tensor): pc for pc in pieces}

    def rows(full: torch.Tensor, pc: _Piece) -> torch.Tensor:
        return full.reshape(-1)[pc.start : pc.stop].view(pc.tensor.shape)

    for pc in pieces:
        full = masters.get(pc.name)
        if full is None or tuple(full.shape) != pc.full_shape:
            raise ConfigError(
                f"checkpoint {path} has no parameter {pc.name!r} of shape {pc.full_shape}; "
                "was it saved from the same model?"
            )
        with torch.no_grad():
            pc.tensor.copy_(rows(full, pc))
    saved = checkpoint.get("optimizer")
    if optimizer is not None and saved is not None:
        if len(saved["param_groups"]) != len(optimizer.param_groups):
            raise ConfigError(
                f"checkpoint {path} has {len(saved['param_groups'])} optimizer param groups, "
                f"the optimizer {len(optimizer.param_groups)}; build it with the same groups"
            )
        state: dict[int, dict[str, Any]] = {}
        groups = []
        index = 0
        for g, saved_group in zip(optimizer.param_groups, saved["param_groups"], strict=True):
            ids = []
            for t in g["params"]:
                pc = by_id.get(id(t))
                entry = saved["state"].get(pc.name) if pc is not None else None
                if pc is not None and entry is not None:
                    state[index] = {
                        k: rows(v, pc)
                        if isinstance(v, torch.Tensor)
                        and v.numel() == math.prod(pc.full_shape)
                        and v.dim() > 0
                        else v
                        for k, v in entry.items()
                    }
                ids.append(index)
                index += 1
            groups.append(
                {**{k: v for k, v in saved_group.items() if k != "params"}, "params": ids}
            )
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    object.__setattr__(model, "_optim_ahead", True)
    model.sync_optim_param()
    return checkpoint.get("extra")
