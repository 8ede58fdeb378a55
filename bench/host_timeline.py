"""Host-side timeline of the engine's threads, for bench/profile_train.py.

torch.profiler records CPU ops of the profiling thread only, so the controller and
optimizer threads are invisible in its trace. This module wraps the engine functions where
those threads block or issue work (job bodies, throttling, event waits, uploads, the
optimizer's publish/fold and Adam) and records (thread, label, start, end) spans with a
wall clock that lines up with the Kineto trace (microseconds since the epoch).
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

Span = tuple[str, str, float, float]

_spans: list[Span] = []
_lock = threading.Lock()
_on = False


def _now_us() -> float:
    return time.time_ns() / 1000


def _record(label: str, t0: float, t1: float) -> None:
    if _on:
        with _lock:
            _spans.append((threading.current_thread().name, label, t0, t1))


def _wrap(fn: Callable[..., Any], label: str | Callable[..., str]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = _now_us()
        try:
            return fn(*args, **kwargs)
        finally:
            name = label(*args, **kwargs) if callable(label) else label
            _record(name, t0, _now_us())

    return wrapper


def _caller_label(prefix: str) -> Callable[..., str]:
    def label(*_: Any, **__: Any) -> str:
        # two frames up: wrapper -> the engine function that waited
        f = sys._getframe(2)
        return f"{prefix}:{f.f_code.co_name}:{f.f_lineno}"

    return label


def install() -> None:
    """Patch the engine (idempotent); spans are recorded only between start() and stop()."""
    from engine import device, roundpipe, roundpipe_base, run, run_state, transfer
    from engine.optim import Adam

    if getattr(run, "_host_timeline", False):
        return
    run._host_timeline = True  # type: ignore[attr-defined]
    run_state.RunState.wait = _wrap(run_state.RunState.wait, _caller_label("wait"))  # type: ignore[method-assign]
    device.DeviceManager.throttle = _wrap(device.DeviceManager.throttle, "throttle")  # type: ignore[method-assign]
    for name in ("forward_job", "fused_job", "backward_job"):
        # roundpipe launches the jobs through its own imported names
        setattr(roundpipe, name, _wrap(getattr(run, name), f"job:{name}"))
    for name in ("upload_layers", "async_h2d", "async_d2h", "download_buffers"):
        wrapped = _wrap(getattr(transfer, name), name)
        setattr(transfer, name, wrapped)
        if hasattr(run, name):
            setattr(run, name, wrapped)
        if hasattr(roundpipe, name):
            setattr(roundpipe, name, wrapped)
    run.download_param_grads = _wrap(run.download_param_grads, "download_param_grads")  # type: ignore[assignment]
    roundpipe_base.publish_weights_take_grads = _wrap(  # type: ignore[assignment]
        roundpipe_base.publish_weights_take_grads, "optim:publish+fold"
    )
    Adam.step = _wrap(Adam.step, "optim:adam")  # type: ignore[method-assign]


def start() -> None:
    global _on
    with _lock:
        _spans.clear()
    _on = True


def stop() -> list[Span]:
    global _on
    _on = False
    with _lock:
        return list(_spans)


def summarize(spans: list[Span], t0: float, t1: float) -> dict[str, dict[str, float]]:
    """Milliseconds per thread and label inside [t0, t1] (nested spans counted in each)."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for thread, label, a, b in spans:
        a, b = max(a, t0), min(b, t1)
        if b > a:
            out[thread][label] = round(out[thread].get(label, 0.0) + (b - a) / 1000, 1)
    return dict(out)


def _innermost(spans: list[Span], thread: str, t: float) -> str:
    """The label of the shortest span of `thread` covering time t, or 'idle'."""
    best: Span | None = None
    for sp in spans:
        if (
            sp[0] == thread
            and sp[2] <= t <= sp[3]
            and (best is None or sp[3] - sp[2] < best[3] - best[2])
        ):
            best = sp
    if best is None:
        return "no-job"
    return "issuing" if best[1].startswith("job:") else best[1]


def gpu_gaps(
    trace: dict[str, Any],
    spans: list[Span],
    window: tuple[float, float],
    offset_us: float,
    min_gap_us: float = 200.0,
) -> dict[str, Any]:
    """Idle time of the busiest GPU stream inside `window` (host clock), attributed to what
    each controller thread was doing in the middle of each gap.

    `offset_us` converts trace time to host time (host = trace + offset).
    """
    by_stream: dict[Any, list[tuple[float, float, str]]] = defaultdict(list)
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and ev.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            a = float(ev["ts"]) + offset_us
            by_stream[(ev.get("pid"), ev.get("tid"))].append((a, a + float(ev["dur"]), ev["name"]))
    busy = {
        k: sum(b - a for a, b, _ in v if window[0] <= a <= window[1]) for k, v in by_stream.items()
    }
    if not busy:
        return {}
    compute = max(busy, key=lambda k: busy[k])
    evs = sorted(e for e in by_stream[compute] if window[0] <= e[0] <= window[1])
    controllers = sorted({sp[0] for sp in spans if sp[0].startswith("rp-device")})
    gaps: dict[str, float] = defaultdict(float)
    biggest: list[tuple[float, float, str, str]] = []
    prev_end = window[0]
    for a, b, name in [*evs, (window[1], window[1], "<end>")]:
        gap = a - prev_end
        if gap >= min_gap_us:
            mid = prev_end + gap / 2
            states = ",".join(_innermost(spans, c, mid) for c in controllers) or "?"
            gaps[states] += gap
            biggest.append((gap, prev_end, states, name))
        prev_end = max(prev_end, b)
    biggest.sort(reverse=True)
    return {
        "stream": str(compute),
        "window_ms": round((window[1] - window[0]) / 1000, 1),
        "busy_ms": {
            str(k): round(v / 1000, 1) for k, v in sorted(busy.items(), key=lambda kv: -kv[1])
        },
        "idle_ms_by_controller_state": {
            k: round(v / 1000, 1) for k, v in sorted(gaps.items(), key=lambda kv: -kv[1])
        },
        "largest_gaps": [
            {
                "ms": round(g / 1000, 2),
                "at_ms": round((t - window[0]) / 1000, 1),
                "controller": s,
                "next": n[:60],
            }
            for g, t, s, n in biggest[:25]
        ],
    }
