"""Splitting argument trees into micro-batches and merging outputs back.

Chunk specs are those of `torch.distributed.pipelining.microbatch`: `TensorChunkSpec(dim)`
splits a tensor along `dim`, `_Replicate` (or a non-tensor) gives every micro-batch the
same value. `guess_split_spec` infers them: tensors whose dim 0 is the batch size are
chunked, everything else is replicated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.pipelining.microbatch import (
    TensorChunkSpec,
    _CustomReducer,
    _Replicate,
    sum_reducer,
)
from torch.utils import _pytree as pytree

from .errors import ConfigError, SplitError

__all__ = [
    "AvgReducer",
    "Batch",
    "RoundPipePackedData",
    "TensorChunkSpec",
    "avg_reducer",
    "even_counts",
    "guess_split_spec",
    "merge_outputs",
    "row_bounds",
    "split_args_kwargs",
    "split_label",
    "split_rows",
    "sum_reducer",
]


class RoundPipePackedData(list):  # type: ignore[type-arg]
    """Per-micro-batch outputs kept apart (merge_output=False).

    Passed as the input of another RoundPipe model, its micro-batches are used as they are,
    without merging and re-splitting.
    """

    def __init__(self, data: list[Any], transfer_event: list[Any] | None = None) -> None:
        super().__init__(data)
        self.transfer_event = transfer_event or [None] * len(data)

    def synchronize(self) -> None:
        """Block until every hosted tensor has arrived."""
        for ev in self.transfer_event:
            if ev is not None:
                ev.synchronize()


def _is_chunkable(t: Any, batch: int | None) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() >= 1 and (batch is None or t.size(0) == batch)


def guess_split_spec(data: Any, expected_batchsize: int | None = None) -> tuple[Any, int | None]:
    """Infer chunk specs for a pytree: `(spec tree, batch size or None)`.

    Without `expected_batchsize`, the batch size is dim 0 of the first tensor with at
    least one dimension; tensors with that dim 0 are chunked along it, others replicated.
    """
    leaves, spec = pytree.tree_flatten(data)
    batch = expected_batchsize
    if batch is None:
        for leaf in leaves:
            if _is_chunkable(leaf, None):
                batch = leaf.size(0)
                break
    specs = [TensorChunkSpec(0) if _is_chunkable(x, batch) else _Replicate for x in leaves]
    found = any(isinstance(s, TensorChunkSpec) for s in specs)
    return pytree.tree_unflatten(specs, spec), (batch if found else None)


def _split_leaves(
    leaves: list[Any], specs: list[Any], num_microbatch: int, what: str
) -> list[list[Any]]:
    """Split flat leaves per their specs into `num_microbatch` flat lists."""
    columns: list[list[Any]] = []
    for leaf, s in zip(leaves, specs, strict=True):
        if isinstance(s, TensorChunkSpec) and isinstance(leaf, torch.Tensor):
            size = leaf.size(s.split_dim)
            if size < num_microbatch:
                raise ConfigError(
                    f"cannot split {what} of size {size} along dim {s.split_dim} into "
                    f"num_microbatch={num_microbatch} parts; use num_microbatch <= {size} "
                    "or a larger batch"
                )
            columns.append(list(torch.tensor_split(leaf, num_microbatch, dim=s.split_dim)))
        else:
            columns.append([leaf] * num_microbatch)
    return [[col[i] for col in columns] for i in range(num_microbatch)]


def _specs_for(data: Any, spec: Any, batch_hint: int | None, what: str) -> tuple[list[Any], Any]:
    leaves, tree = pytree.tree_flatten(data)
    if spec is None:
        guessed, _ = guess_split_spec(data, batch_hint)
        specs = pytree.tree_flatten(guessed)[0]
    else:
        try:
            specs = pytree.tree_flatten(spec)[0]
        except Exception as exc:  # a malformed spec tree
            raise ConfigError(f"{what}: the split spec does not mirror the data: {exc}") from exc
        if len(specs) != len(leaves):
            raise ConfigError(
                f"{what}: the split spec has {len(specs)} leaves but the data has {len(leaves)}; "
                "give one TensorChunkSpec or _Replicate per leaf"
            )
    return specs, (leaves, tree)


Rows = list[tuple[tuple[Any, ...], dict[str, Any]]]


def split_args_kwargs(
    args: tuple[Any, ...], kwargs: dict[str, Any], num_microbatch: int, split_input: Any
) -> tuple[Rows, int | None]:
    """Split forward arguments into micro-batches: `([(args_i, kwargs_i)], batch size)`."""
    rows, batch, _ = _split_with_specs(args, kwargs, num_microbatch, split_input)
    return rows, batch


def _split_with_specs(
    args: tuple[Any, ...], kwargs: dict[str, Any], num_microbatch: int, split_input: Any
) -> tuple[Rows, int | None, list[Any] | None]:
    """`split_args_kwargs` and the flat chunk specs it split by (None for a callable
    split_input)."""
    if callable(split_input) and not isinstance(split_input, (tuple, list)):
        parts = split_input(args, kwargs, num_microbatch)
        if not isinstance(parts, Sequence) or len(parts) != num_microbatch:
            raise SplitError(
                f"split_input returned {type(parts).__name__} of length "
                f"{len(parts) if isinstance(parts, Sequence) else '?'}; it must return a list of "
                f"num_microbatch={num_microbatch} (args, kwargs) pairs"
            )
        out = []
        for p in parts:
            if not (isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[1], dict)):
                raise SplitError("split_input must return (args tuple, kwargs dict) pairs")
            out.append((tuple(p[0]), dict(p[1])))
        return out, None, None
    _, batch = guess_split_spec((args, kwargs))
    specs, (leaves, tree) = _specs_for((args, kwargs), split_input, batch, "input")
    if batch is None and split_input is None and num_microbatch > 1:
        raise ConfigError(
            f"no input tensor has a batch dimension to split into num_microbatch={num_microbatch} "
            "parts; pass batched tensors, split_input, or num_microbatch=1"
        )
    rows = _split_leaves(leaves, specs, num_microbatch, "the input batch")
    result = []
    for row in rows:
        a, k = pytree.tree_unflatten(row, tree)
        result.append((tuple(a), dict(k)))
    return result, batch, specs


def split_label(label: Any, num_microbatch: int, split_spec: Any, batch: int | None) -> list[Any]:
    """Split the label like the inputs; a batch size that disagrees is an error."""
    if label is None:
        return [None] * num_microbatch
    if callable(split_spec) and not isinstance(split_spec, (tuple, list)):
        parts = split_spec(label, num_microbatch)
        if not isinstance(parts, Sequence) or len(parts) != num_microbatch:
            raise SplitError(
                f"split_label must return a list of num_microbatch={num_microbatch} labels"
            )
        return list(parts)
    if split_spec is None and batch is not None:
        for leaf in pytree.tree_leaves(label):
            if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1 and leaf.size(0) != batch:
                raise ConfigError(
                    f"label batch size {leaf.size(0)} does not match the input batch size "
                    f"{batch}; give labels with one row per input row (or pass split_label)"
                )
    specs, (leaves, tree) = _specs_for(label, split_spec, batch, "label")
    return [
        pytree.tree_unflatten(row, tree)
        for row in _split_leaves(leaves, specs, num_microbatch, "the label")
    ]


def even_counts(items: int, parts: int) -> list[int]:
    """Items per micro-batch: `items` over at most `parts` micro-batches (never an empty
    one), as even as can be, the first ones one larger."""
    if items < 1:
        raise ConfigError(f"a batch needs at least one item to split, got {items}")
    parts = max(1, min(parts, items))
    base, extra = divmod(items, parts)
    return [base + 1] * extra + [base] * (parts - extra)


def row_bounds(counts: Sequence[int], *, rows_per_item: int = 1) -> list[tuple[int, int]]:
    """The row range `[start, stop)` of each micro-batch of `counts` items, an item being
    `rows_per_item` consecutive rows (2 for a preference pair: chosen, rejected)."""
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + rows_per_item * c))
        start += rows_per_item * c
    return bounds


def split_rows(bounds: Sequence[tuple[int, int]]) -> SplitFn:
    """A `split_input` callable for `len(bounds)` micro-batches: every tensor argument
    whose dim 0 is the batch's rows (the last bound's stop) is cut on `bounds`; other
    arguments go to every micro-batch. For splits the even automatic one does not make
    (items of several rows, a split the caller needs to know)."""
    bounds = list(bounds)
    rows = bounds[-1][1]

    def cut(value: Any, a: int, b: int) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
            return value[a:b]
        return value

    def split(args: tuple[Any, ...], kwargs: dict[str, Any], num_microbatch: int) -> list[Any]:
        if num_microbatch != len(bounds):
            raise SplitError(
                f"split for {len(bounds)} micro-batches, asked for num_microbatch={num_microbatch}"
            )
        return [
            (tuple(cut(v, a, b) for v in args), {k: cut(v, a, b) for k, v in kwargs.items()})
            for a, b in bounds
        ]

    return split


def merge_outputs(outputs: list[Any], merge_output: Any) -> Any:
    """Merge per-micro-batch outputs: concatenate batched tensors, keep equal values.

    `merge_output` may be True (automatic), a callable over the list, or a spec tree
    mirroring one output of TensorChunkSpec(dim) (concatenate along dim), _Replicate (the
    first micro-batch's) and reducers (`avg_reducer`, torch's `sum_reducer`, any
    `_CustomReducer`: folded over the micro-batches in order).
    """
    if callable(merge_output) and not isinstance(merge_output, (bool, tuple, list, dict)):
        return merge_output(outputs)
    flat = [pytree.tree_flatten(o) for o in outputs]
    tree = flat[0][1]
    if any(t != tree for _, t in flat[1:]):
        raise ConfigError(
            "micro-batch outputs have different structures and cannot be merged; "
            "pass merge_output=<callable> or merge_output=False"
        )
    specs: list[Any] | None = None
    if merge_output is not True:
        specs = pytree.tree_flatten(merge_output)[0]
    merged: list[Any] = []
    for j in range(len(flat[0][0])):
        column = [leaves[j] for leaves, _ in flat]
        s = specs[j] if specs is not None else None
        merged.append(_merge_column(column, s))
    return pytree.tree_unflatten(merged, tree)


def _merge_column(column: list[Any], spec: Any) -> Any:
    if isinstance(spec, _CustomReducer):
        reduced = spec.init_value
        for value in column:
            reduced = spec.reduce_fn(reduced, value)
        return reduced
    first = column[0]
    if isinstance(first, torch.Tensor):
        if spec is _Replicate:
            return first
        dim = spec.split_dim if isinstance(spec, TensorChunkSpec) else 0
        if first.dim() == 0:
            return torch.stack(column)
        return torch.cat(column, dim=dim)
    if all(c == first for c in column[1:]):
        return first
    return list(column)


class AvgReducer(_CustomReducer):
    """Running mean of scalar losses across micro-batches: a merge_output spec that averages
    (its fold starts from None, which resets the running sum and count)."""

    def __init__(self) -> None:
        super().__init__(None, self.reduce)
        self.sum: torch.Tensor | None = None
        self.count = 0
        self._last: torch.Tensor | None = None  # what the fold in progress was given back

    def reduce(self, reduced_val: torch.Tensor | None, new_val: torch.Tensor) -> torch.Tensor:
        """Fold `new_val` into the running mean and return the mean.

        Raises:
            AssertionError: `reduced_val` is not the mean this reducer returned last: the
                same instance is folding two reductions at once (give each an AvgReducer()).
        """
        if reduced_val is None:
            self.sum, self.count = None, 0
        elif reduced_val is not self._last:
            raise AssertionError(
                "this AvgReducer is folding two reductions at the same time; use one "
                "AvgReducer() per reduction"
            )
        self.sum = new_val.detach().clone() if self.sum is None else self.sum + new_val.detach()
        self.count += 1
        self._last = self.sum / self.count
        return self._last


avg_reducer = AvgReducer()

SplitFn = Callable[..., list[Any]]


class Batch:
    """One call's micro-batches, flattened: the split inputs and labels on the way in, the
    outputs on the way out (`store_outputs`, then `dump`).

    RoundPipe builds one per forward / forward_backward from the effective run config
    (`FullRoundPipeRunConfig`: num_microbatch, split_input, split_label, merge_output).

    Attributes:
        flatten_states: per micro-batch, the flat leaves of `(args, kwargs)` (after
            `store_outputs`, of its output).
        flatten_specs: per micro-batch, the TreeSpec that rebuilds them.
        forward_events / backward_events: per micro-batch, the events after which the
            host data (and its gradients) are valid; empty where nothing is in flight.
        num_microbatch: micro-batches actually made (a packed input keeps its own count).
        label_list: the label of each micro-batch (None without a label).
        loss_list: the losses of each micro-batch, once a training call has them.
        loss_ready: an event set when every loss is on the host (None: nothing to wait).
        batch_size: the rows split (None for a custom split_input or a packed input).
        split_specs: the inputs' flat chunk specs (None for a custom split_input or a
            packed input): how an input's gradient is put back together.
        requires_grad: per leaf of the first micro-batch, whether it is a tensor that
            requires grad.
    """

    def __init__(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        run_config: Any,
        label: Any = None,
    ) -> None:
        """Split `(args, kwargs)` and `label` by `run_config`; a RoundPipePackedData (the
        merge_output=False outputs of the model before) is taken micro-batch by micro-batch.

        Raises:
            ConfigError: a packed input among other arguments, or inputs / labels that do
                not split into num_microbatch parts.
            SplitError: a custom split_input / split_label returned a malformed list.
        """
        rows, self.batch_size, self.split_specs = _split_call(args, kwargs, run_config)
        self.flatten_states: list[list[Any]] = []
        self.flatten_specs: list[Any] = []
        for row in rows:
            leaves, tree = pytree.tree_flatten(row)
            self.flatten_states.append(leaves)
            self.flatten_specs.append(tree)
        self.num_microbatch: int = len(rows)
        first = self.flatten_states[0] if rows else []
        self.requires_grad = [isinstance(t, torch.Tensor) and t.requires_grad for t in first]
        self.label_list = split_label(
            label, self.num_microbatch, run_config.split_label, self.batch_size
        )
        self.forward_events: list[Sequence[Any]] = [() for _ in rows]
        self.backward_events: list[Sequence[Any]] = [() for _ in rows]
        self.loss_list: list[Any] = []
        self.loss_ready: Any = None

    def store_outputs(self, outputs: list[Any]) -> None:
        """Take the call's outputs (one pytree per micro-batch, on the host once the call
        has joined its jobs) as the state `dump` merges."""
        if len(outputs) != self.num_microbatch:
            raise ValueError(f"{len(outputs)} outputs for {self.num_microbatch} micro-batches")
        flat = [pytree.tree_flatten(o) for o in outputs]
        self.flatten_states = [leaves for leaves, _ in flat]
        self.flatten_specs = [tree for _, tree in flat]

    def outputs(self) -> list[Any]:
        """The state as one pytree per micro-batch."""
        return [
            pytree.tree_unflatten(leaves, tree)
            for leaves, tree in zip(self.flatten_states, self.flatten_specs, strict=True)
        ]

    def dump(self, run_config: Any) -> Any:
        """The micro-batches merged by `run_config.merge_output`; with merge_output=False a
        RoundPipePackedData that the next RoundPipe model takes as it is, without merging
        and re-splitting."""
        if run_config.merge_output is False:
            events = [ev[0] if ev else None for ev in self.forward_events]
            return RoundPipePackedData(self.outputs(), events)
        for events in self.forward_events:
            for ev in events:
                ev.synchronize()
        return merge_outputs(self.outputs(), run_config.merge_output)


def _split_call(
    args: tuple[Any, ...], kwargs: dict[str, Any], run_config: Any
) -> tuple[Rows, int | None, list[Any] | None]:
    """(micro-batch rows, batch size, flat chunk specs) of one call's arguments."""
    if len(args) == 1 and not kwargs and isinstance(args[0], RoundPipePackedData):
        packed = args[0]
        packed.synchronize()
        return [((x,), {}) for x in packed], None, None
    if any(isinstance(x, RoundPipePackedData) for x in pytree.tree_leaves((args, kwargs))):
        raise ConfigError(
            "a RoundPipePackedData (merge_output=False outputs) is taken as the only "
            "input, rp(packed); to pass more arguments, merge it first (merge_output "
            "left on) or let the model before return them with it"
        )
    return _split_with_specs(args, kwargs, run_config.num_microbatch, run_config.split_input)
