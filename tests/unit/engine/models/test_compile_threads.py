"""engine.models._compile: a compiled call stays compiled while another thread FX-traces.

Inductor FX-traces while it compiles, and that sets a process-wide flag. Before the fix, a
compiled call from another device thread then ran eagerly (the same math fused otherwise),
so results depended on whether another GPU was compiling at that moment (issue 43). Here
another thread holds the flag for real, inside `torch.fx.symbolic_trace`.
"""

from __future__ import annotations

import threading

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from engine.models._compile import compile_for_devices


class _TraceHeldOpen(torch.nn.Module):
    """A module whose symbolic trace waits until told to finish (the flag stays set)."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = threading.Event()
        self.release = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inside.set()
        self.release.wait(30)
        return x + 1


def _double_plus_one(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def test_a_compiled_call_compiles_while_another_thread_fx_traces() -> None:
    torch._dynamo.reset()
    compiled = compile_for_devices(_double_plus_one, backend="eager")
    tracing = _TraceHeldOpen()
    tracer = threading.Thread(target=torch.fx.symbolic_trace, args=(tracing,))
    tracer.start()
    try:
        assert tracing.inside.wait(30)
        assert torch.fx._symbolic_trace.is_fx_symbolic_tracing()
        before = counters["stats"]["unique_graphs"]
        out = compiled(torch.arange(4.0))
        built = counters["stats"]["unique_graphs"] - before
    finally:
        tracing.release.set()
        tracer.join(30)
        torch._dynamo.reset()
    assert torch.equal(out, torch.tensor([1.0, 3.0, 5.0, 7.0]))
    # 0 is the eager fallback: the function ran without dynamo
    assert built == 1
