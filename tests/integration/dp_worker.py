"""What each rank of the data-parallel tests runs (imported by spawned processes).

A small nn.Sequential of odd sizes trained with RoundPipe; `train()` is also the
single-process oracle (process_group=None). Every scenario writes its results to
`out_dir/<name>-rank<r>.pt` for the test to compare.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

GLOBAL_ROWS = 12  # the global batch: 6 rows a rank with 2 ranks, 3 with 4
MICROBATCHES_PER_RANK = 2
STEPS = 3
LR = 1e-2


class TiedOut(nn.Module):
    """x @ W with the first layer's weight: a tied parameter used by two layers (owner 0),
    like a tied embedding and LM head."""

    def __init__(self, tied: nn.Linear) -> None:
        super().__init__()
        self.tied = tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.tied.weight


def make_model(width: int = 17) -> nn.Sequential:
    """Layers of odd sizes; the Tanh has no parameters (an empty shard); the last layer
    reuses the first one's weight."""
    torch.manual_seed(0)
    first = nn.Linear(5, width)
    return nn.Sequential(
        first,
        nn.Tanh(),
        nn.Linear(width, 13),
        nn.LayerNorm(13),
        nn.Linear(13, width),
        TiedOut(first),
    )


def batch(k: int, rows: int = GLOBAL_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + k)
    return torch.randn(rows, 5, generator=gen), torch.randn(rows, 5, generator=gen)


def loss_fn(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # Normalised by the global batch, as for micro-batches: sums over ranks to the mean.
    return ((outputs - labels) ** 2).sum() / GLOBAL_ROWS


def build(
    *,
    shard: bool,
    microbatches: int,
    optimizer: str,
    process_group: Any,
    width: int = 17,
    batch_is_global: bool | None = None,
    staleness: int = 1,
) -> tuple[Any, torch.optim.Optimizer]:
    from engine import RoundPipe, RoundPipeRunConfig
    from engine.optim import Adam
    from engine.parallel.data_parallel import AUTO_GROUP

    rp = RoundPipe(
        make_model(width),
        optim_dtype=torch.float32,
        model_run_config=RoundPipeRunConfig(
            num_microbatch=microbatches, batch_is_global=batch_is_global
        ),
        process_group=AUTO_GROUP if process_group == "auto" else process_group,
        shard_optimizer=shard,
        step_staleness=staleness,
    )
    if optimizer == "torch":
        opt: torch.optim.Optimizer = torch.optim.AdamW(
            rp.optim_parameters(), lr=LR, weight_decay=0.1
        )
    else:
        opt = Adam(rp.optim_parameters(), lr=LR, weight_decay=0.1, decoupled_weight_decay=True)
    return rp, opt


def run_steps(
    rp: Any,
    opt: torch.optim.Optimizer,
    first: int,
    last: int,
    sync: bool,
    norms: list[float] | None = None,
    rows: slice = slice(None),
) -> list[float]:
    """Steps `first..last` on batch(k)[rows] (all rows: the global batch); the losses."""
    from engine.parallel.data_parallel import grad_norm

    def step_fn() -> None:
        if norms is not None:
            norms.append(grad_norm(rp))  # global on every rank, as clipping needs it
        opt.step()
        opt.zero_grad(set_to_none=True)

    losses = []
    for k in range(first, last):
        x, y = batch(k)
        losses.append(float(rp.forward_backward((x[rows],), label=y[rows], loss_fn=loss_fn)))
        rp.step(step_fn, is_async=not sync)
    return losses


def train(
    *,
    sync: bool,
    shard: bool,
    optimizer: str = "engine",
    process_group: Any = "auto",
    world: int = 1,
    staleness: int = 1,
) -> dict[str, Any]:
    """3 steps, then a forward_backward without a step; losses, `.grad` and weights."""
    # A rank splits its share into its own micro-batches; the one process splits the
    # global batch into as many as all ranks together.
    rp, opt = build(
        shard=shard,
        microbatches=MICROBATCHES_PER_RANK * (world if process_group is None else 1),
        optimizer=optimizer,
        process_group=process_group,
        staleness=staleness,
    )
    norms: list[float] = []
    losses = run_steps(rp, opt, 0, STEPS, sync, norms)
    x, y = batch(STEPS)
    losses.append(float(rp.forward_backward((x,), label=y, loss_fn=loss_fn)))
    # Data parallel reduces a call's gradients while its backward runs (engine.fold_ahead):
    # none is left for the step once the call has returned.
    from engine.attribute import ParamAttribute

    pending = sum(ParamAttribute.get(p).grad_pending for p in rp.parameters())
    # ... and kept each reduced gradient's sum of squares for the step's norm (engine.optim._sumsq)
    from engine.optim import _sumsq

    grads = [p.grad for p in rp.optim_parameters() if p.grad is not None]
    kept = (sum(_sumsq.kept(g) is not None for g in grads), len(grads), _sumsq.can_keep())
    rp.synchronize()
    return {
        "pending_after_call": pending,
        "kept_after_call": kept,
        # layers gathered while step_fn ran (staleness zero, engine.optim.Adam's reports)
        "early_layers": sum(phases["early_layers"] for phases in rp.step_phases),
        "losses": losses,
        "norms": norms,
        "grads": {n: p.grad.clone() for n, p in rp.named_parameters()},
        "weights": {n: p.detach().clone() for n, p in rp.named_parameters()},
        "shard_numel": sum(p.numel() for p in rp.optim_parameters()),
    }


def accumulate(
    *, process_group: Any = "auto", world: int = 1, staleness: int = 1
) -> dict[str, Any]:
    """Two calls a step (gradient accumulation), two steps: each call's gradients are reduced
    during its own backward and added in fp32 (engine.fold_ahead's data-parallel kernel)."""
    rp, opt = build(
        shard=True,
        microbatches=MICROBATCHES_PER_RANK * (world if process_group is None else 1),
        optimizer="engine",
        process_group=process_group,
        staleness=staleness,
    )

    def step_fn() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    losses = []
    for k in range(4):
        x, y = batch(10 + k)
        losses.append(float(rp.forward_backward((x,), label=y, loss_fn=loss_fn)))
        if k % 2:
            rp.step(step_fn, is_async=True)
    rp.synchronize()
    return {"losses": losses, "weights": {n: p.detach().clone() for n, p in rp.named_parameters()}}


def resume(
    path: str, *, first: int, last: int, save_to: str | None, process_group: Any
) -> dict[str, Any]:
    """Load a checkpoint, take sync steps `first..last`, optionally save again."""
    from engine.parallel.data_parallel import load_checkpoint, save_checkpoint

    rp, opt = build(shard=True, microbatches=2, optimizer="engine", process_group=process_group)
    extra = load_checkpoint(path, rp, opt)
    losses = run_steps(rp, opt, first, last, sync=True)
    if save_to:
        save_checkpoint(save_to, rp, opt, extra={"step": last})
    rp.synchronize()
    return {
        "extra": extra,
        "losses": losses,
        "weights": {n: p.detach().clone() for n, p in rp.named_parameters()},
    }


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 17)
        self.b = nn.Linear(17, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _auto_split() -> None:
    """A model the auto-split wraps as an AutoRoundPipe: refused under a process group."""
    from engine import wrap_model_to_roundpipe

    wrap_model_to_roundpipe(
        _TwoLayers(), use_sequential_preset=False, lower_threshold=0, upper_threshold=500
    )


def gloo_worker_threads() -> int:
    """How many gloo worker threads ('pt_gloo_runloop', two a group) this process runs."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except (FileNotFoundError, ProcessLookupError):
            # the thread ended since the listing (its comm read raises either, depending on
            # when it went): not running
            continue
    return names.count("pt_gloo_runloop")


def _modes(rank: int, world: int) -> dict[str, Any]:
    """The two batch modes side by side, a mismatched batch, then close()."""
    from engine import RoundPipeRunConfig

    mine = slice(rank * GLOBAL_ROWS // world, (rank + 1) * GLOBAL_ROWS // world)
    result: dict[str, Any] = {}

    def train_mode(rp: Any, opt: torch.optim.Optimizer, rows: slice) -> dict[str, Any]:
        losses = run_steps(rp, opt, 0, STEPS, sync=False, rows=rows)
        rp.synchronize()
        weights = {n: p.detach().clone() for n, p in rp.named_parameters()}
        return {"losses": losses, "weights": weights}

    def build_mode(batch_is_global: bool) -> tuple[Any, torch.optim.Optimizer]:
        return build(
            shard=True,
            microbatches=MICROBATCHES_PER_RANK,
            optimizer="engine",
            process_group="auto",
            batch_is_global=batch_is_global,
        )

    rp, opt = build_mode(True)
    with rp:  # closed at the block's end: its groups go with it
        result["global"] = train_mode(rp, opt, slice(None))
    rp, opt = build_mode(False)
    result["shard"] = train_mode(rp, opt, mine)
    # The shard-mode model given the global batch for one call, a different one per rank.
    x, y = batch(7 if rank == 0 else 8)
    start = time.monotonic()
    result["mismatch"] = _expect_error(
        lambda: rp.forward_backward(
            (x,), label=y, loss_fn=loss_fn, run_config=RoundPipeRunConfig(batch_is_global=True)
        )
    )
    result["mismatch_s"] = time.monotonic() - start
    x, y = batch(7, rows=GLOBAL_ROWS + world)  # other shapes on one rank only
    result["mismatch_shape"] = _expect_error(
        lambda: rp.forward_backward(
            (x if rank == 0 else x[:GLOBAL_ROWS],),
            label=y if rank == 0 else y[:GLOBAL_ROWS],
            loss_fn=loss_fn,
            run_config=RoundPipeRunConfig(batch_is_global=True),
        )
    )
    x, y = batch(7)
    result["after_mismatch"] = float(
        rp.forward_backward(
            (x,), label=y, loss_fn=loss_fn, run_config=RoundPipeRunConfig(batch_is_global=True)
        )
    )
    # close(): the engine's two groups go (two gloo worker threads each); idempotent.
    result["gloo_threads_open"] = gloo_worker_threads()
    rp.close()
    rp.close()
    result["gloo_threads_closed"] = gloo_worker_threads()
    result["after_close"] = _expect_error(
        lambda: rp.forward_backward((x,), label=y, loss_fn=loss_fn)
    )
    return result


def _init(rank: int, world: int, port: int, timeout_s: float, nccl: bool = False) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = None
    if nccl:  # one GPU a rank, TF32 off so fp32 compares tightly
        os.environ["RP_DEVICES"] = f"cuda:{rank}"
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        os.environ["RP_DEVICES"] = "cpu:1"
    dist.init_process_group(
        "nccl" if nccl else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device,
    )


def _expect_error(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def rank_main(rank: int, world: int, port: int, out_dir: str, scenario: str) -> None:
    """Entry point of one spawned rank."""
    out = Path(out_dir)
    try:
        _init(rank, world, port, 20.0 if scenario != "dead" else 5.0, nccl=scenario == "nccl")
        result: dict[str, Any] = {}
        if scenario == "nccl":
            for sync, shard in ((False, True), (True, False)):
                result[f"sync={sync},shard={shard}"] = train(sync=sync, shard=shard, world=world)
            # the staleness-zero step: reductions during the backward, gathers as updated
            result["fresh,shard=True"] = train(sync=False, shard=True, world=world, staleness=0)
        elif scenario == "equal":
            for sync in (True, False):
                for shard in (True, False):
                    result[f"sync={sync},shard={shard}"] = train(
                        sync=sync, shard=shard, world=world
                    )
            result["torch-adamw"] = train(sync=False, shard=True, optimizer="torch", world=world)
            for staleness in (0, 1):
                result[f"accumulate,staleness={staleness}"] = accumulate(
                    world=world, staleness=staleness
                )
            for shard in (True, False):  # step_staleness=0: the sync step's results
                result[f"fresh,shard={shard}"] = train(
                    sync=False, shard=shard, world=world, staleness=0
                )
            rp, opt = build(shard=True, microbatches=2, optimizer="engine", process_group="auto")
            result["ckpt_losses"] = run_steps(rp, opt, 0, STEPS, sync=True)
            from engine.parallel.data_parallel import save_checkpoint

            save_checkpoint(out / "ckpt-2ranks.pt", rp, opt, extra={"step": STEPS})
        elif scenario == "back":
            result["resume"] = resume(
                str(out / "ckpt-1rank.pt"),
                first=STEPS + 2,
                last=STEPS + 3,
                save_to=None,
                process_group="auto",
            )
            rp, _ = build(shard=True, microbatches=2, optimizer="engine", process_group="auto")
            x, y = batch(0, rows=GLOBAL_ROWS - 1)
            result["odd_batch"] = _expect_error(
                lambda: rp.forward_backward((x,), label=y, loss_fn=loss_fn)
            )
            # Still usable after the refused call: a good batch goes through.
            x, y = batch(0)
            result["after_odd"] = float(rp.forward_backward((x,), label=y, loss_fn=loss_fn))
            result["auto_split"] = _expect_error(_auto_split)
            result["mismatch"] = _expect_error(
                lambda: build(
                    shard=True,
                    microbatches=2,
                    optimizer="engine",
                    process_group="auto",
                    width=17 if rank == 0 else 19,
                )
            )
        elif scenario == "modes":
            result = _modes(rank, world)
        elif scenario == "dead":
            rp, opt = build(shard=True, microbatches=2, optimizer="engine", process_group="auto")
            run_steps(rp, opt, 0, 1, sync=False)
            rp.synchronize()
            if rank == 1:
                os._exit(3)  # dies without a word, as a killed process does
            start = time.monotonic()
            result["error"] = _expect_error(lambda: run_steps(rp, opt, 1, 50, sync=False))
            result["elapsed_s"] = time.monotonic() - start
        torch.save(result, out / f"{scenario}-rank{rank}.pt")
    except BaseException:
        (out / f"{scenario}-rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    # Leave without torch.distributed's teardown: a dead peer can keep it waiting.
    os._exit(0)


def fork_ranks(root: Path, runs: int, world: int, at_once: int, timeout_s: float) -> Any:
    """Fork `runs` runs of `world` ranks, `at_once` runs at a time, from this process (torch
    and the engine imported once, no thread started yet); write `codes.json`.

    The parent never returns: it exits once every run has ended. Each child returns
    (rank, world, port, out_dir) with stderr sent to `out_dir/rank<r>.log`, runs the rank
    at module level and ends with the interpreter's own exit, as a script does.
    """
    import json
    import signal
    import socket

    todo = list(range(runs))
    running: dict[int, tuple[float, dict[int, int | None]]] = {}  # run: start, pid: code
    codes: dict[int, list[int]] = {}
    while todo or running:
        while todo and len(running) < at_once:
            k = todo.pop(0)
            out = root / f"run{k}"
            out.mkdir()
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = str(s.getsockname()[1])
            pids: dict[int, int | None] = {}
            for r in range(world):
                pid = os.fork()
                if pid == 0:
                    os.dup2(os.open(out / f"rank{r}.log", os.O_WRONLY | os.O_CREAT), 2)
                    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
                    return r, world, port, out
                pids[pid] = None
            running[k] = (time.monotonic(), pids)
        for k, (started, pids) in list(running.items()):
            late = time.monotonic() - started > timeout_s
            for pid, code in pids.items():
                if code is None:
                    if late:
                        os.kill(pid, signal.SIGKILL)
                    done, status = os.waitpid(pid, 0 if late else os.WNOHANG)
                    if done:
                        pids[pid] = os.waitstatus_to_exitcode(status)
            if None not in pids.values():
                codes[k] = [code for code in pids.values() if code is not None]
                del running[k]
        time.sleep(0.05)
    (root / "codes.json").write_text(json.dumps(codes))
    os._exit(0)


if __name__ == "__main__":
    # python -m tests.integration.dp_worker ROOT RUNS WORLD AT_ONCE TIMEOUT_S: RUNS runs of
    # WORLD forked rank processes, each a whole rank as a user writes it, at module level:
    # asynchronous steps, synchronize, a checkpoint, destroy_process_group(), then the
    # interpreter's own exit (no os._exit). Exit status 0 means it ran to its end (an
    # exception exits with 1). The model stays referenced to the exit, as a script's
    # globals are, and nothing runs after the destroy: a model freed earlier, or a call
    # that releases the GIL, would hide the race it is for. The imports happen once, before
    # the forks: they are most of a rank's time.
    import importlib
    import sys

    import torch.distributed as dist

    from engine.parallel.data_parallel import save_checkpoint

    for _name in ("engine", "engine.optim", "engine.parallel.data_parallel"):
        importlib.import_module(_name)  # what build() and run_steps() import, before the forks
    _rank, _world, _port, _out = fork_ranks(
        Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    )
    os.environ["RP_DEVICES"] = "cpu:1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{_port}",
        rank=_rank,
        world_size=_world,
        timeout=datetime.timedelta(seconds=30),
    )
    model, optimizer = build(shard=True, microbatches=2, optimizer="engine", process_group="auto")
    run_steps(model, optimizer, 0, STEPS, sync=False)
    model.synchronize()
    save_checkpoint(Path(_out) / "ckpt.pt", model, optimizer, extra={"step": STEPS})
    dist.destroy_process_group()
