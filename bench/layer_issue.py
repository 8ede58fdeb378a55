"""Host time to issue a decoder layer group: torch.compile'd calls against CUDA graph replay.

One process issues all of RoundPipe's work for every GPU it drives, so the Python time per
layer and micro-batch bounds how many GPUs one process can keep busy (bench/RESULTS.md,
"host issue time"). This measures, for a group of preset decoder layers on one GPU, in a
worker thread on a side stream as the engine's device threads run them:

- `compiled`: the engine's path today: the no-grad forward (saving the attention output for
  the recompute) and the recompute with grad + backward (replaying the saved attention);
- `graph`: the same two passes captured once as CUDA graphs and replayed.

and checks that a replay gives the same bits as the compiled calls (outputs, saved
attention, input and parameter gradients). Prints one JSON line per (pass, path) with the
issue time per call (host time from the call to its return, no synchronisation) and the
wall time per call once the GPU has finished (GPU-bound for big shapes).

    python bench/layer_issue.py --model tiny28 --layers 4       # host-bound: issue time
    python bench/layer_issue.py --model qwen3-1.7b --layers 1   # equality, GPU time
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from bench.shapes import SHAPES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(SHAPES), default="tiny28")
    p.add_argument("--layers", type=int, default=1, help="decoder layers in the group")
    p.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--calls", type=int, default=50, help="timed calls per measurement")
    return p.parse_args(argv)


def build_group(args: argparse.Namespace) -> tuple[list[torch.nn.Module], int]:
    """The preset's first `--layers` decoder layers on the GPU in fp16, compiled."""
    from bench.shapes import build_model
    from engine.models import _decoder, to_sequential

    model = build_model(args.model, torch.float16, "sdpa", 0, layers=args.layers)
    seq = to_sequential(model)
    layers = [seq[k].cuda() for k in range(1, 1 + args.layers)]
    # transformers builds a real mask where it sees a CUDA graph being captured; the
    # calls here are plain causal (no padding mask), whose mask is None outside capture.
    _decoder.build_causal_mask = lambda *a, **k: None
    return layers, model.config.hidden_size


def carry(hidden: torch.Tensor) -> tuple[Any, ...]:
    from engine.models._carry import HeadOptions

    return (hidden, None, None, None, None, HeadOptions())


def forward_saving(layers: list[torch.nn.Module], x: torch.Tensor) -> tuple[torch.Tensor, list]:
    """No-grad forward of the group; each layer's saved attention (output, lse)."""
    from engine.context import ForwardCtx

    saved: list[tuple[torch.Tensor, ...]] = []
    cur = carry(x)
    with torch.no_grad():
        for layer in layers:
            with ForwardCtx(lambda *data: saved.append(data)):
                cur = layer(cur)
    return cur[0], saved


def recompute_backward(
    layers: list[torch.nn.Module], x: torch.Tensor, grad_out: torch.Tensor, saved: list
) -> torch.Tensor:
    """Stage recompute of the group (replaying saved attention) and its backward; returns
    the input gradient (parameter gradients accumulate in .grad)."""
    from engine.context import RecomputeCtx

    leaf = x.detach().requires_grad_(True)
    cur = carry(leaf)
    with torch.enable_grad():
        for layer, data in zip(layers, saved, strict=True):
            with RecomputeCtx(tuple(data) if data else None):
                cur = layer(cur)
        torch.autograd.backward(cur[0], grad_out)
    assert leaf.grad is not None
    return leaf.grad


def timed(fn: Callable[[], Any], calls: int, stream: torch.cuda.Stream) -> tuple[float, float]:
    """(issue ms per call, wall ms per call once the stream is done)."""
    stream.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    stream.synchronize()
    done = time.perf_counter()
    return (issued - start) * 1e3 / calls, (done - start) * 1e3 / calls


def probe(args: argparse.Namespace) -> list[dict[str, Any]]:
    layers, hidden = build_group(args)
    params = [p for layer in layers for p in layer.parameters()]
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.batch, args.seq_len, hidden)
    x = torch.randn(shape, device="cuda", dtype=torch.float16, generator=gen)
    g = torch.randn(shape, device="cuda", dtype=torch.float16, generator=gen) * 1e-2
    stream = torch.cuda.Stream()
    rows: list[dict[str, Any]] = []
    with torch.cuda.stream(stream):
        # Compile and check the saved path is taken (saved pairs exist on CUDA half).
        for _ in range(3):
            out_ref, saved_ref = forward_saving(layers, x)
            for p in params:
                p.grad = None
            gx_ref = recompute_backward(layers, x, g, saved_ref)
        grads_ref = [p.grad.clone() for p in params]
        n_saved = sum(len(s) for s in saved_ref)
        # Whether the compiled calls themselves give the same bits twice (a backward with
        # atomics would not, and then neither can a replay).
        for p in params:
            p.grad = None
        gx_again = recompute_backward(layers, x, g, saved_ref)
        eager_repeatable = torch.equal(gx_again, gx_ref) and all(
            torch.equal(p.grad, r) for p, r in zip(params, grads_ref, strict=True)
        )

        def compiled_fwd() -> None:
            forward_saving(layers, x)

        def compiled_bwd() -> None:
            recompute_backward(layers, x, g, saved_ref)

        for name, fn in (("forward", compiled_fwd), ("recompute_backward", compiled_bwd)):
            issue, wall = timed(fn, args.calls, stream)
            rows.append({"pass": name, "path": "compiled", "issue_ms": issue, "wall_ms": wall})

        # Static inputs, captured graphs in one private pool.
        pool = torch.cuda.graph_pool_handle()
        sx, sg = x.clone(), g.clone()
        s_saved = [tuple(t.clone() for t in pair) for pair in saved_ref]
        fwd_graph = torch.cuda.CUDAGraph()
        stream.synchronize()
        fwd_graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        s_out, s_saved_out = forward_saving(layers, sx)
        fwd_graph.capture_end()
        for p in params:
            p.grad = torch.zeros_like(p)
        bwd_graph = torch.cuda.CUDAGraph()
        bwd_graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        s_gx = recompute_backward(layers, sx, sg, s_saved)
        bwd_graph.capture_end()

        fwd_graph.replay()
        bwd_graph.replay()
        stream.synchronize()
        same = {
            "output": torch.equal(s_out, out_ref),
            "saved_attention": all(
                torch.equal(a, b)
                for pa, pb in zip(s_saved_out, saved_ref, strict=True)
                for a, b in zip(pa, pb, strict=True)
            ),
            "input_grad": torch.equal(s_gx, gx_ref),
            "param_grads": all(
                torch.equal(p.grad, r) for p, r in zip(params, grads_ref, strict=True)
            ),
        }
        for name, graph in (("forward", fwd_graph), ("recompute_backward", bwd_graph)):
            issue, wall = timed(graph.replay, args.calls, stream)
            rows.append({"pass": name, "path": "graph", "issue_ms": issue, "wall_ms": wall})
    for r in rows:
        r.update(
            bench="layer_issue",
            model=args.model,
            layers=args.layers,
            tokens=args.batch * args.seq_len,
            saved_tensors=n_saved,
            bitwise_equal=same,
            compiled_repeatable=eager_repeatable,
            issue_ms=round(r["issue_ms"], 4),
            wall_ms=round(r["wall_ms"], 4),
            device=torch.cuda.get_device_name(),
            torch=torch.__version__,
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out: list[dict[str, Any]] = []
    errors: list[BaseException] = []

    def worker() -> None:  # a device thread, as in the engine
        try:
            out.extend(probe(args))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    t = threading.Thread(target=worker, name="rp-device-0")
    t.start()
    t.join()
    if errors:
        raise errors[0]
    for row in out:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
