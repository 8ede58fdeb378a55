"""The engine's own host-memory check before it pins a model: the bytes its live tensors will
take (the model copy, the gradient buffers, the optimizer-side copies), counted as
`memory_plan` counts them, against the budget. Apart from `memory_plan` because it reads
a real model's parameters (and imports torch), where the plan works from shapes alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .memory_plan import (
    HostMemoryPlan,
    RunShape,
    _cuda_pinned,
    _pinned_bytes,
    default_budget_bytes,
    process_rss_bytes,
)

__all__ = ["check_engine_allocation"]


def check_engine_allocation(
    model: Any,
    *,
    optim_dtype: Any,
    optim_grad_dtype: Any,
    pin_model: str,
    budget_bytes: int | None,
    double_buffer_weights: bool = False,
    optim_memory: str = "default",
) -> HostMemoryPlan:
    """Before RoundPipe pins `model`: check what the engine itself will allocate.

    Counts the pinned model copy, the host gradient buffers, the optimizer-side copies and
    their gradient buffers of `model`'s parameters, and with `double_buffer_weights` the
    second model copy (the optimizer's own state and the activations depend on the
    optimizer and the batch: see plan_host_memory). Raises
    HostMemoryError over the budget (`budget_bytes`, else RP_HOST_MEMORY_BUDGET, else the
    available memory less a margin).
    """
    import torch

    from ..accel.weight_buffers import takes_second_copy
    from ..device import host_memory_budget_setting  # imports torch: only on this path
    from ..memory import host_tensors

    cuda = torch.cuda.is_available()
    seen: set[int] = set()
    parts = {
        "model": 0,
        "host_gradients": 0,
        "optim_master": 0,
        "optim_gradients": 0,
        "model_second_copy": 0,
    }
    for p in _unique(model.parameters(), seen):
        nbytes = p.numel() * p.element_size()
        # A packed frozen weight (NF4) is held as its packed tensors, pinned one by one.
        parts["model"] += sum(
            _pinned_bytes(t.numel() * t.element_size(), pin_model, cuda) for t in host_tensors(p)
        )
        if not p.requires_grad:
            continue
        opt_dtype = optim_dtype or p.dtype
        parts["host_gradients"] += (
            _pinned_bytes(nbytes, "arena", cuda)
            if pin_model == "arena"
            else _cuda_pinned(nbytes, cuda)
        )
        if optim_memory == "compact":  # the weights are the masters, the gradient in place
            continue
        parts["optim_master"] += p.numel() * opt_dtype.itemsize
        if (optim_grad_dtype or opt_dtype) == opt_dtype:
            parts["optim_gradients"] += p.numel() * opt_dtype.itemsize
        if double_buffer_weights and takes_second_copy(p.dtype, opt_dtype):
            parts["model_second_copy"] += _pinned_bytes(nbytes, "arena", cuda)
    for b in _unique(model.buffers(), seen):
        parts["model"] += _pinned_bytes(b.numel() * b.element_size(), pin_model, cuda)
    plan = HostMemoryPlan(
        parts,
        RunShape(tokens_per_step=1, seq_len=1, pin_model=pin_model, cuda=cuda),  # type: ignore[arg-type]
        None,
    )
    budget = budget_bytes
    if budget is None:
        # The model already lives in this process: what is available now plus what the
        # process holds is what it may use in all.
        budget = default_budget_bytes(
            host_memory_budget_setting(), in_use_bytes=process_rss_bytes()
        )
    plan.check(budget)
    return plan


def _unique(tensors: Iterable[Any], seen: set[int]) -> Iterable[Any]:
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            yield t
