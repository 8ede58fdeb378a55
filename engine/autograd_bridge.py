"""The autograd bridge: a RoundPipe forward's outputs joined to the caller's autograd graph.

`forward` runs outside autograd (its jobs run on device threads); `attach_backward` gives
its merged outputs one autograd node (`_RoundPipeBackward`) whose backward splits the
output gradients per micro-batch, runs the model's backward jobs and returns the inputs'
gradients. `backprop_to_inputs` does the input side for `forward_backward`, whose backward
has already run: it sends the inputs' gradients on into the graph they came from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from .batch import TensorChunkSpec, _Replicate
from .errors import ConfigError
from .run_config import FullRoundPipeRunConfig
from .run_state import Act, RunState

if TYPE_CHECKING:
    from .roundpipe import RoundPipe

__all__ = ["attach_backward", "backprop_to_inputs"]


def _merge_input_grads(
    run: RunState, n_leaves: int, flags: list[bool], specs: list[Any] | None
) -> list[torch.Tensor | None]:
    """Per-leaf gradients of the original inputs from the per-micro-batch gradients."""
    grads: list[torch.Tensor | None] = []
    for k in range(n_leaves):
        if not flags[k]:
            grads.append(None)
            continue
        parts = [a.leaves[k] if a is not None else None for a in run.input_grads]
        if any(p is None for p in parts):
            grads.append(None)
            continue
        spec = specs[k] if specs is not None else TensorChunkSpec(0)
        if isinstance(spec, TensorChunkSpec):
            grads.append(torch.cat(parts, dim=spec.split_dim))
        else:  # replicated: every micro-batch contributed
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            grads.append(total)
    return grads


def backprop_to_inputs(
    run: RunState, args: tuple[Any, ...], kwargs: dict[str, Any], specs: list[Any] | None
) -> None:
    """Send the input gradients of forward_backward into the graph the inputs came from."""
    leaves, _ = pytree.tree_flatten((args, kwargs))
    flags = [isinstance(t, torch.Tensor) and t.requires_grad for t in leaves]
    grads = _merge_input_grads(run, len(leaves), flags, specs)
    pairs = [(t, g) for t, g, f in zip(leaves, grads, flags, strict=True) if f and g is not None]
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g.to(t.device) for t, g in pairs])


class _RoundPipeBackward(torch.autograd.Function):
    """Connects a RoundPipe forward's outputs to autograd; backward runs the backward jobs."""

    @staticmethod
    def forward(ctx: Any, handle: dict[str, Any], tag: torch.Tensor, *inputs: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.handle = handle
        outs = handle["float_outputs"]
        return tuple(o.detach() for o in outs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> Any:  # type: ignore[override]
        h = ctx.handle
        run: RunState = h["run"]
        model: RoundPipe = h["model"]
        per_mb_outputs: list[list[Any]] = h["per_mb_leaves"]
        float_idx: list[int] = h["float_idx"]
        out_specs: list[Any] = h["out_specs"]
        m = run.num_microbatch
        per_mb_grads: list[list[Any]] = [[None] * len(per_mb_outputs[0]) for _ in range(m)]
        for g, k in zip(grad_outputs, float_idx, strict=True):
            if g is None:
                continue
            column = [leaves[k] for leaves in per_mb_outputs]
            spec = out_specs[k]
            if spec is _Replicate:
                per_mb_grads[0][k] = g
                continue
            if column[0].dim() == 0:
                pieces = list(g.unbind(0))
            else:
                dim = spec.split_dim if isinstance(spec, TensorChunkSpec) else 0
                pieces = list(torch.split(g, [c.size(dim) for c in column], dim=dim))
            for i in range(m):
                per_mb_grads[i][k] = pieces[i].contiguous()
        run.grad_states = [Act(per_mb_grads[i], None, None) for i in range(m)]
        model._run_backward(run)
        grads = _merge_input_grads(run, len(h["input_leaves"]), h["input_flags"], h["input_specs"])
        req = [g for g, f in zip(grads, h["input_flags"], strict=True) if f]
        return (None, None, *req)


def attach_backward(
    model: RoundPipe,
    run: RunState,
    merged: Any,
    outputs: list[Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    specs: list[Any] | None,
    cfg: FullRoundPipeRunConfig,
) -> Any:
    leaves, tree = pytree.tree_flatten(merged)
    float_idx = [
        k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    if not float_idx:
        return merged
    if callable(cfg.merge_output) and not isinstance(cfg.merge_output, (bool, tuple, list, dict)):
        raise ConfigError(
            "a merge_output callable cannot carry gradients back through forward(); "
            "use forward_backward(), the automatic merge, or a chunk-spec tree"
        )
    out_specs = (
        [True] * len(leaves)
        if cfg.merge_output is True
        else pytree.tree_flatten(cfg.merge_output)[0]
    )
    input_leaves, _ = pytree.tree_flatten((args, kwargs))
    input_flags = [isinstance(t, torch.Tensor) and t.requires_grad for t in input_leaves]
    handle = {
        "run": run,
        "model": model,
        "float_outputs": [leaves[k] for k in float_idx],
        "float_idx": float_idx,
        "per_mb_leaves": [pytree.tree_flatten(o)[0] for o in outputs],
        "out_specs": out_specs,
        "input_leaves": input_leaves,
        "input_flags": input_flags,
        "input_specs": specs,
    }
    tag = torch.zeros((), requires_grad=True)
    req_inputs = [t for t, f in zip(input_leaves, input_flags, strict=True) if f]
    outs = _RoundPipeBackward.apply(handle, tag, *req_inputs)
    new_leaves = list(leaves)
    for k, o in zip(float_idx, outs, strict=True):
        new_leaves[k] = o
    return pytree.tree_unflatten(new_leaves, tree)
