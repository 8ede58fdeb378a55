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

from .batch import (
    AvgReducer,
    RoundPipePackedData,
    TensorChunkSpec,
    _CustomReducer,
    _Replicate,
    sum_reducer,
)
from .errors import ConfigError
from .run_config import FullRoundPipeRunConfig
from .run_state import HostData, RunState

if TYPE_CHECKING:
    from .roundpipe import RoundPipe

__all__ = ["attach_backward", "attach_backward_packed", "backprop_to_inputs"]


def _merge_input_grads(
    run: RunState, n_leaves: int, flags: list[bool], specs: list[Any] | None
) -> list[torch.Tensor | None]:
    """Per-leaf gradients of the original inputs from the per-micro-batch gradients."""
    grads: list[torch.Tensor | None] = []
    for k in range(n_leaves):
        if not flags[k]:
            grads.append(None)
            continue
        parts = [a.leaves[k] if a is not None else None for a in run.flow.input_grads]
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


def _inputs_needing_grad(
    args: tuple[Any, ...], kwargs: dict[str, Any], specs: list[Any] | None
) -> tuple[list[torch.Tensor], Any]:
    """The input tensors that require grad, and a function of a finished run that gives
    their gradients in the same order. A RoundPipePackedData passed alone (another model's
    `merge_output=False` outputs) is its micro-batches: micro-batch i's tensor gets micro-
    batch i's gradient, nothing is merged."""
    if len(args) == 1 and not kwargs and isinstance(args[0], RoundPipePackedData):
        wanted = [  # (micro-batch, leaf, tensor): a micro-batch's output may be a tree
            (i, k, t)
            for i, out in enumerate(args[0])
            for k, t in enumerate(pytree.tree_leaves(out))
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]

        def packed_grads(run: RunState) -> list[torch.Tensor | None]:
            grads = run.flow.input_grads
            return [grads[i].leaves[k] if grads[i] is not None else None for i, k, _ in wanted]

        return [t for _, _, t in wanted], packed_grads
    leaves, _ = pytree.tree_flatten((args, kwargs))
    flags = [isinstance(t, torch.Tensor) and t.requires_grad for t in leaves]

    def merged_grads(run: RunState) -> list[torch.Tensor | None]:
        grads = _merge_input_grads(run, len(leaves), flags, specs)
        return [g for g, f in zip(grads, flags, strict=True) if f]

    return [t for t, f in zip(leaves, flags, strict=True) if f], merged_grads


def backprop_to_inputs(
    run: RunState, args: tuple[Any, ...], kwargs: dict[str, Any], specs: list[Any] | None
) -> None:
    """Send the input gradients of forward_backward into the graph the inputs came from."""
    tensors, grads_of = _inputs_needing_grad(args, kwargs, specs)
    pairs = [(t, g) for t, g in zip(tensors, grads_of(run), strict=True) if g is not None]
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
        per_mb_grads = h["to_micro_batches"](run.num_microbatch, grad_outputs)
        run.flow.output_grads = [HostData(g, None, None) for g in per_mb_grads]
        h["model"]._run_backward(run)
        return (None, None, *h["input_grads"](run))


def _split_merged_grads(
    per_mb_outputs: list[list[Any]], float_idx: list[int], out_specs: list[Any]
) -> Any:
    """The merged outputs' gradients cut back into micro-batches, as each leaf was merged."""

    def split(m: int, grad_outputs: tuple[torch.Tensor | None, ...]) -> list[list[Any]]:
        per_mb_grads: list[list[Any]] = [[None] * len(per_mb_outputs[0]) for _ in range(m)]
        for g, k in zip(grad_outputs, float_idx, strict=True):
            if g is None:
                continue
            column = [leaves[k] for leaves in per_mb_outputs]
            spec = out_specs[k]
            if spec is _Replicate:
                per_mb_grads[0][k] = g
                continue
            if isinstance(spec, _CustomReducer):  # a sum's gradient reaches every micro-batch
                pieces = [g / m if isinstance(spec, AvgReducer) else g] * m
            elif column[0].dim() == 0:
                pieces = list(g.unbind(0))
            else:
                dim = spec.split_dim if isinstance(spec, TensorChunkSpec) else 0
                pieces = list(torch.split(g, [c.size(dim) for c in column], dim=dim))
            for i in range(m):
                per_mb_grads[i][k] = pieces[i].contiguous()
        return per_mb_grads

    return split


def _attach(
    model: RoundPipe,
    run: RunState,
    float_outputs: list[torch.Tensor],
    to_micro_batches: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    specs: list[Any] | None,
) -> tuple[torch.Tensor, ...]:
    """`float_outputs` as outputs of one autograd node whose backward runs the model's
    backward jobs (their gradients cut per micro-batch by `to_micro_batches`)."""
    req_inputs, input_grads = _inputs_needing_grad(args, kwargs, specs)
    handle = {
        "run": run,
        "model": model,
        "float_outputs": float_outputs,
        "to_micro_batches": to_micro_batches,
        "input_grads": input_grads,
    }
    tag = torch.zeros((), requires_grad=True)
    return _RoundPipeBackward.apply(handle, tag, *req_inputs)


def _float_indices(leaves: list[Any]) -> list[int]:
    return [
        k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]


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
    """The merged outputs of a forward with gradients, joined to autograd."""
    leaves, tree = pytree.tree_flatten(merged)
    float_idx = _float_indices(leaves)
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
    for k in float_idx:
        spec = out_specs[k]
        if isinstance(spec, _CustomReducer) and not _is_sum_or_mean(spec):
            raise ConfigError(
                "a custom reducer in merge_output cannot carry gradients back through "
                "forward(); use avg_reducer or sum_reducer, or forward_backward()"
            )
    per_mb = [pytree.tree_flatten(o)[0] for o in outputs]
    split = _split_merged_grads(per_mb, float_idx, out_specs)
    outs = _attach(model, run, [leaves[k] for k in float_idx], split, args, kwargs, specs)
    new_leaves = list(leaves)
    for k, o in zip(float_idx, outs, strict=True):
        new_leaves[k] = o
    return pytree.tree_unflatten(new_leaves, tree)


def attach_backward_packed(
    model: RoundPipe,
    run: RunState,
    outputs: list[Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    specs: list[Any] | None,
) -> list[Any]:
    """The per-micro-batch outputs of a forward with gradients (merge_output=False), joined
    to autograd: micro-batch i's gradients are those of its own outputs, nothing is cut."""
    flat = [pytree.tree_flatten(o) for o in outputs]
    float_idx = _float_indices(flat[0][0])
    if not float_idx:
        return outputs

    def to_micro_batches(m: int, grad_outputs: tuple[torch.Tensor | None, ...]) -> list[list[Any]]:
        per_mb: list[list[Any]] = [[None] * len(flat[0][0]) for _ in range(m)]
        it = iter(grad_outputs)
        for i in range(m):
            for k in float_idx:
                g = next(it)
                per_mb[i][k] = None if g is None else g.contiguous()
        return per_mb

    float_outputs = [leaves[k] for leaves, _ in flat for k in float_idx]
    outs = iter(_attach(model, run, float_outputs, to_micro_batches, args, kwargs, specs))
    joined = []
    for leaves, tree in flat:
        new_leaves = list(leaves)
        for k in float_idx:
            new_leaves[k] = next(outs)
        joined.append(pytree.tree_unflatten(new_leaves, tree))
    return joined


def _is_sum_or_mean(spec: Any) -> bool:
    return isinstance(spec, AvgReducer) or spec is sum_reducer
