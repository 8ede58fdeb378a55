"""Data parallel over torch.distributed: one RoundPipe per rank, ZeRO-1 state on the host.

Over ~800 lines: the shard layout, the gradient reduce, the step's all-gather and the
engine's own process groups (with their teardown) are one protocol that every rank must
run in the same order; split, the order would be spread over files. The staleness-zero
step's gathers-as-updated are engine.parallel.publish.

Every rank (process) runs one RoundPipe over its own devices. `RoundPipe` turns this on
when a process group is in effect: the one passed as `process_group=`, else the default
group when `torch.distributed` is initialised with more than one rank
(`process_group=None` keeps a rank single-process).

The batch, two ways (`RoundPipeRunConfig.batch_is_global`, model- or call-level):
- global (the default, True): `forward_backward` takes the *global* batch on every rank
  (the same script runs unchanged under torchrun) and keeps rank r's r-th equal share of
  its rows; the rows must split equally. Every call first checks that the ranks were
  given the same batch: one small all-reduce of a digest (structure, shapes, dtypes and
  exactly rounded sums of up to 128 strided samples per tensor, label included); where
  they differ, every rank raises ConfigError naming `batch_is_global=False`. A sample
  check: batches that differ only where nothing was sampled pass it.
- shard (False): each rank passes its own rows (a DistributedSampler's, the
  DistributedDataParallel habit), used as given, unchecked; shards may differ in size.
  Rank r given rows r of the global batch trains exactly as the global mode does.
Either way ranks are more micro-batches: the loss_fn normalises by the global batch (as
`causal_lm_loss_fn(labels)` does with the whole labels), gradients are summed across
ranks, and the returned loss is the sum over every rank's micro-batches, so each rank
returns the global loss.

The step keeps the protocol of `engine.attribute` on every rank. While a call's backward
runs, the optimizer thread sums each layer's gradients across ranks as soon as they are down,
the last layer first (`reduce_ahead`, engine.fold_ahead's kernel; sharded: reduce-scatter,
each rank keeping its shard; else all-reduce) and folds them into the optimizer-side
gradients. The step then, per layer: publishes w[k] (sharded: all-gathers the updated
half-precision shards into the model's parameters), sets param_copied; reduces, in the order
the next backward downloads (by last use, descending: a tied embedding first), whatever is
still pending (nothing, unless the fold-ahead switch is off) and sets grad_copied. With
staleness one these collectives run while the next call computes; with staleness zero the
weights are published layer 0 first after step_fn (`publish_in_order`). NCCL ranks bounce
host tensors through their first GPU; gloo ranks reduce host tensors in place.

The shard (ZeRO stage 1, `shard_optimizer=True`). Each layer's parameters, flattened in
order, are cut into one range per rank at row (dim 0) boundaries, so each rank's piece of
a parameter is a block of its rows with the parameter's trailing shape. The rank keeps
the fp32 master (and, through its optimizer, the Adam state) of its pieces only: inside a
step_fn `parameters()` / `optim_parameters()` yield those pieces, so `engine.optim.Adam`
or any element-wise torch optimizer built from them steps exactly what the single-process
run steps. A step_fn that needs a global quantity (a gradient norm for clipping, a
GradScaler's inf check) must reduce it across ranks itself; see `grad_norm`.

Checkpoints (`save_checkpoint` / `load_checkpoint`, engine.parallel.checkpoint, re-exported here):
a full save from rank 0, keyed by parameter name (fp32 masters, optimizer state and
groups), that any number of ranks, one included, loads by slicing its pieces.

Teardown. The engine's two groups (`control`, `bulk`) and its threads must be gone before
the interpreter finalizes: a gloo worker thread still freeing a finished collective then
aborts the process (see DataParallel.close). `RoundPipe.close()` (or `with RoundPipe(...)
as rp:`) waits for the queued steps, destroys those groups and joins their threads; it
runs by itself at interpreter exit, so a script that ends with
`torch.distributed.destroy_process_group()` needs nothing more. A process that goes on
after destroying its process group calls `rp.close()` before it (and `rp.synchronize()`
before that to read the latest weights); a closed model's collectives raise ConfigError.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from ..batch import RoundPipePackedData, guess_split_spec, split_args_kwargs, split_label
from ..device import get_devices
from ..errors import ConfigError, DistributedError
from ..optim import _sumsq
from ..optim_stream import synchronize_optim
from .checkpoint import load_checkpoint, save_checkpoint  # re-exported: the DP API
from .publish import PublishAsUpdated

if TYPE_CHECKING:
    from ..attribute import ParamAttribute
    from ..roundpipe import RoundPipe, RoundPipeBase

__all__ = [
    "AUTO_GROUP",
    "DataParallel",
    "attach_data_parallel",
    "grad_norm",
    "load_checkpoint",
    "save_checkpoint",
]


log = logging.getLogger(__name__)

# Timeout of the groups made here when the user's group does not say its own.
DEFAULT_TIMEOUT_S = 600.0


class _Auto:
    def __repr__(self) -> str:
        return "AUTO_GROUP"


AUTO_GROUP: Any = _Auto()
"""`process_group` default: the default group when torch.distributed is initialised."""


def resolve_process_group(process_group: Any) -> Any:
    """The group to go data parallel over, or None to stay single-process."""
    if process_group is None:
        return None
    if process_group is AUTO_GROUP:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        process_group = dist.group.WORLD
    elif not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "process_group was given but torch.distributed is not initialised; call "
            "torch.distributed.init_process_group() first (torchrun sets its environment)"
        )
    if dist.get_world_size(process_group) < 2:
        return None
    return process_group


def attach_data_parallel(
    model: RoundPipe, process_group: Any, *, shard_optimizer: bool
) -> DataParallel | None:
    """Set up data parallel for a freshly built RoundPipe (collective), or return None."""
    group = resolve_process_group(process_group)
    if group is None:
        return None
    return DataParallel(model, group, shard_optimizer=shard_optimizer)


@contextlib.contextmanager
def _collective(what: str, rank: int, world: int, timeout_s: float) -> Iterator[None]:
    """Turn a failed collective into a DistributedError that says what probably happened."""
    try:
        yield
    except DistributedError:
        raise
    except (RuntimeError, ValueError) as exc:
        raise DistributedError(
            f"data parallel: {what} failed on rank {rank} of {world}: another rank died, "
            f"left, or did not reach the same call within the {timeout_s:.0f} s timeout "
            f"({type(exc).__name__}: {exc})"
        ) from exc


def _bulk_backend(backend: str) -> str:
    """The one backend of the gradient and weight group, from the caller's group's.

    A per-device pair ("cpu:gloo,cuda:nccl") and `init_process_group()` without a backend
    (reported as "undefined": torch then builds the accelerator's backend alone, NCCL on a
    GPU box, and no CPU one) both leave the choice to the engine: NCCL where this rank
    computes on GPUs, gloo where it does not. Taking either string as it is gave the bulk
    group no backend for the start-up broadcast's tensors (seen on torch 2.11, 2 H200s)."""
    if backend == "nccl" or ("nccl" not in backend and backend != "undefined"):
        return backend
    return "nccl" if any(d.is_cuda for d in get_devices()) else "gloo"


def _group_timeout(group: Any) -> datetime.timedelta:
    """The user's group timeout, where torch lets us read it (else DEFAULT_TIMEOUT_S)."""
    for device in ("cpu", "cuda"):
        with contextlib.suppress(Exception):
            timeout = group._get_backend(torch.device(device)).options._timeout
            if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
                return timeout
    return datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)


# torch 2.13 renamed the tensor collectives; the GPU machine's 2.11 has only the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(slots=True)
class _Span:
    """A run of one parameter's flat elements that one rank owns."""

    param: int  # index into the layout's params
    rank: int
    start: int  # first element, in the parameter's flat view
    stop: int
    seg: int  # where it sits in the layer's flat buffer (rank * seg_len + offset)


class _LayerLayout:
    """How one layer's trainable parameters are cut across ranks and laid out in buffers."""

    def __init__(
        self,
        params: list[tuple[nn.Parameter, ParamAttribute, str]],
        world: int,
        rank: int,
        sharded: bool,
    ) -> None:
        self.params = params
        dtypes = {p.dtype for p, _, _ in params}
        # One buffer per layer: in the model dtype, or fp32 for a layer of mixed dtypes.
        self.dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        sizes = [(p.numel(), _row_numel(p)) for p, _, _ in params]
        offsets = [0]
        for n, _ in sizes:
            offsets.append(offsets[-1] + n)
        total = offsets[-1]
        self.spans: list[_Span] = []
        if not sharded:
            self.seg_len = total
            for i, (n, _) in enumerate(sizes):
                if n:
                    self.spans.append(_Span(i, rank, 0, n, offsets[i]))
            self.mine = list(self.spans)
            return
        cuts = _row_cuts(sizes, offsets, world)
        self.seg_len = max(1, *(cuts[r + 1] - cuts[r] for r in range(world)))
        for r in range(world):
            lo, hi = cuts[r], cuts[r + 1]
            for i, (n, _) in enumerate(sizes):
                a, b = max(lo, offsets[i]), min(hi, offsets[i] + n)
                if a < b:
                    self.spans.append(
                        _Span(i, r, a - offsets[i], b - offsets[i], r * self.seg_len + a - lo)
                    )
        self.mine = [s for s in self.spans if s.rank == rank]


def _row_numel(p: torch.Tensor) -> int:
    return p.numel() // p.shape[0] if p.dim() > 0 and p.shape[0] > 0 else max(1, p.numel())


def _row_cuts(sizes: list[tuple[int, int]], offsets: list[int], world: int) -> list[int]:
    """world + 1 cut points over the layer's flat elements, each on a row boundary."""
    total = offsets[-1]
    cuts = [0]
    for k in range(1, world):
        target = k * total // world
        cut = total
        for i, (n, row) in enumerate(sizes):
            if offsets[i] <= target < offsets[i] + n:
                cut = offsets[i] + round((target - offsets[i]) / row) * row
                break
        cuts.append(min(total, max(cut, cuts[-1])))
    cuts.append(total)
    return cuts


def _reduce_order(model: RoundPipe) -> list[int]:
    """Owner layers in the order the next backward downloads into their gradients.

    The backward runs from the last layer down and each download waits on its owner's
    grad_copied, so owners go by the last layer that uses their parameters, descending.
    A tied embedding (owned by layer 0, used again by the head) thus comes first: in
    plain reverse order the head's download would wait for every other layer's reduction.
    """
    last_use = list(range(model.num_layers))
    for j, params in enumerate(model.layer_params):
        for _, pa in params:
            last_use[pa.owner_layer] = max(last_use[pa.owner_layer], j)
    return sorted(range(model.num_layers), key=lambda o: (-last_use[o], -o))


# Elements sampled per tensor for the same-batch check: evenly strided over the tensor.
_DIGEST_SAMPLES = 128


def _batch_digest(tree: Any) -> torch.Tensor:
    """(3,) float64: a hash of the tree's structure, shapes and dtypes, and two sums of
    strided samples of its tensors (plain and weighted by position, so reordered rows
    show). math.fsum rounds exactly, whatever the order: ranks on different CPUs agree."""
    leaves, spec = pytree.tree_flatten(tree)
    shape_desc = [str(spec)]
    values: list[float] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            shape_desc.append(f"{tuple(leaf.shape)}:{leaf.dtype}")
            flat = leaf.detach().reshape(-1)
            if flat.numel():
                step = max(1, flat.numel() // _DIGEST_SAMPLES)
                samples = flat[::step][:_DIGEST_SAMPLES].to("cpu", torch.float64)
                # Finite and bounded, so the sums below neither overflow nor turn NaN.
                samples = torch.nan_to_num(samples, nan=-1.5, posinf=2.5, neginf=-2.5)
                values += samples.clamp(-1e200, 1e200).tolist()
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            shape_desc.append(repr(leaf))
        else:  # no repr: a default one holds an address, different on every rank
            shape_desc.append(type(leaf).__qualname__)
    digest = hashlib.sha256("\n".join(shape_desc).encode()).digest()
    structure = float(int.from_bytes(digest[:6], "big"))  # 48 bits: exact in a float64
    plain = math.fsum(values)
    weighted = math.fsum(v * (i + 1) for i, v in enumerate(values))
    return torch.tensor([structure, plain, weighted], dtype=torch.float64)


def _piece_shape(p: torch.Tensor, span: _Span) -> tuple[int, ...]:
    if p.dim() == 0:
        return ()
    return ((span.stop - span.start) // _row_numel(p), *p.shape[1:])


class DataParallel:
    """The data-parallel side of one RoundPipe: groups, layouts, shards and collectives.

    Collectives on `bulk` (gradients, weights) run on the optimizer thread, or on the
    main thread only while the optimizer thread is idle (synchronize, checkpoints); the
    small ones on `control` (loss, start-up checks) run on the main thread. Two groups,
    so the two threads never interleave calls on one communicator.
    """

    def __init__(self, model: RoundPipe, group: Any, *, shard_optimizer: bool) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.sharded = bool(shard_optimizer)
        self.closed = False
        ranks = dist.get_process_group_ranks(group)
        timeout = _group_timeout(group)
        self.timeout_s = timeout.total_seconds()
        backend = _bulk_backend(str(dist.get_backend(group)))
        # Every process of the default group must come here: new_group is collective.
        self.control = dist.new_group(ranks, backend="gloo", timeout=timeout)
        self.bulk = dist.new_group(ranks, backend=backend, timeout=timeout)
        self.device = torch.device("cpu")
        self.stream: torch.cuda.Stream | None = None
        if backend == "nccl":
            gpus = [d.device for d in get_devices() if d.is_cuda]
            if not gpus:
                raise ConfigError(
                    "the process group uses NCCL but this rank's RP_DEVICES has no GPU; "
                    "use the gloo backend for CPU ranks"
                )
            self.device = gpus[0]
            self.stream = torch.cuda.Stream(self.device)
        names = {id(p): n for n, p in nn.Module.named_parameters(model)}
        self.layouts = [
            _LayerLayout(
                [(p, pa, names[id(p)]) for p, pa in group_params if pa.optim is not None],
                self.world,
                self.rank,
                self.sharded,
            )
            for group_params in model._params_by_owner()
        ]
        self.reduce_order = _reduce_order(model)
        self._staging: dict[torch.dtype, torch.Tensor] = {}
        # Seconds the optimizer thread spent publishing (all-gather) and reducing, summed
        # over steps: what docs/SCALING.md's cost model predicts from bytes and bandwidth.
        self.stats = {"steps": 0, "publish_s": 0.0, "reduce_s": 0.0}
        self._grad_buffers: dict[int, torch.Tensor] = {}
        self._check_same_model(model)
        self._broadcast_weights(model)
        if self.sharded:
            self._shard_masters()
        log.info(
            "%s: data parallel, rank %d of %d, %s, optimizer state %s",
            model.name,
            self.rank,
            self.world,
            backend,
            "sharded" if self.sharded else "replicated",
        )

    def _guard(self, what: str) -> contextlib.AbstractContextManager[None]:
        self._check_open(what)
        return _collective(what, self.rank, self.world, self.timeout_s)

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise ConfigError(
                f"data parallel: {what} on a closed RoundPipe (close() destroyed its process "
                "groups); build a new RoundPipe to train again"
            )

    # ---- teardown ---------------------------------------------------------------------
    def close(self) -> None:
        """Destroy the two groups made here and join their worker threads (idempotent).

        Why: a gloo worker thread drops its reference to a finished collective after the
        caller's wait has returned, and freeing the tensors it held (their Python objects)
        takes the GIL. A process that reaches interpreter finalization within that window
        (a few ms: destroy_process_group() and exit) kills the waiting thread inside a
        C++ destructor, and the rank aborts ("terminate called without an active
        exception"). The groups' destructor joins their worker threads with the GIL
        released, so once the last reference here is gone, none of those threads is left.
        Call it with the optimizer thread idle (RoundPipe.close waits for it first).
        """
        if self.closed:
            return
        self.closed = True
        for group in (self.bulk, self.control):
            # ValueError: already unregistered by destroy_process_group() of the default group.
            with contextlib.suppress(ValueError):
                dist.destroy_process_group(group)
        # The last references: the groups' C++ destructors run here, joining their threads.
        self.bulk = self.control = self.group = None
        self._staging.clear()
        self._grad_buffers.clear()

    # ---- start-up ---------------------------------------------------------------------
    def _check_same_model(self, model: RoundPipe) -> None:
        """Compare every rank's parameter names, shapes and dtypes with rank 0's."""
        signature = [
            f"{n}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}"
            for n, p in nn.Module.named_parameters(model)
        ]
        digest = hashlib.sha256("\n".join(signature).encode()).hexdigest()
        numel = sum(p.numel() for p in model.parameters())
        mine = (len(signature), numel, digest, signature)
        everyone: list[Any] = [None] * self.world
        with self._guard("the start-up model check"):
            dist.all_gather_object(everyone, mine, group=self.control)
        first = everyone[0]
        for r, theirs in enumerate(everyone):
            if theirs[2] == first[2]:
                continue
            diff = next(
                (
                    f"rank 0 has {a!r}, rank {r} has {b!r}"
                    for a, b in zip(first[3], theirs[3], strict=False)
                    if a != b
                ),
                "one has more parameters than the other",
            )
            raise ConfigError(
                f"data parallel: rank {r}'s model differs from rank 0's ({theirs[0]} parameters, "
                f"{theirs[1]} elements vs {first[0]}, {first[1]}; first difference: {diff}); "
                "every rank must build the same model with the same wrapping"
            )

    def _broadcast_weights(self, model: RoundPipe) -> None:
        """Give every rank rank 0's weights (as DistributedDataParallel does)."""
        seen: set[int] = set()
        with self._guard("the start-up weight broadcast"):
            for p in model.model.parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                data = p.data
                buf = data.to(self.device)
                dist.broadcast(buf, src=dist.get_global_rank(self.bulk, 0), group=self.bulk)
                if buf.data_ptr() != data.data_ptr():
                    data.copy_(buf)
        for layout in self.layouts:
            for p, pa, _ in layout.params:
                pa.optim.data.copy_(p.data)  # type: ignore[union-attr]

    def _shard_masters(self) -> None:
        """Keep only this rank's rows of every fp32 master (the full ones are dropped)."""
        for layout in self.layouts:
            owned = {s.param: s for s in layout.mine}
            for i, (p, pa, _) in enumerate(layout.params):
                span = owned.get(i)
                if span is None:
                    pa.optim = None
                    continue
                full = pa.optim.detach()  # type: ignore[union-attr]
                rows = full.reshape(-1)[span.start : span.stop].view(_piece_shape(p, span))
                pa.optim = nn.Parameter(rows.clone(), requires_grad=True)

    # ---- forward_backward ------------------------------------------------------------
    def take_share(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], label: Any, cfg: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
        """This rank's rows: its equal share of the global batch (inputs and label), or with
        `batch_is_global=False` the inputs as given (this rank's own shard)."""
        self._check_open("forward_backward")
        if not cfg.batch_is_global:
            return args, kwargs, label
        self._check_same_batch(args, kwargs, label)
        if len(args) == 1 and not kwargs and isinstance(args[0], RoundPipePackedData):
            raise ConfigError(
                "data parallel forward_backward needs the global batch as tensors, not "
                "RoundPipePackedData"
            )
        batch = None
        if cfg.split_input is None:
            _, batch = guess_split_spec((args, kwargs))
        if batch is None and cfg.split_input is None:
            raise ConfigError(
                "data parallel forward_backward found no batched tensor in the inputs to "
                "share across ranks; pass tensors with the batch in dim 0 (or split_input)"
            )
        if batch is not None and batch % self.world:
            raise ConfigError(
                f"data parallel: the global batch has {batch} rows, which {self.world} ranks "
                f"cannot share equally; give forward_backward a batch that is a multiple of "
                f"the world size {self.world} (on every rank)"
            )
        rows, batch = split_args_kwargs(args, kwargs, self.world, cfg.split_input)
        my_args, my_kwargs = rows[self.rank]
        my_label = split_label(label, self.world, cfg.split_label, batch)[self.rank]
        return tuple(my_args), dict(my_kwargs), my_label

    def _check_same_batch(self, args: tuple[Any, ...], kwargs: dict[str, Any], label: Any) -> None:
        """Raise ConfigError on every rank unless all were given the same batch (likely).

        One small all-reduce on `control`: the MAX of (digest, -digest) gives each
        entry's largest and smallest value over the ranks, equal only where every rank's
        digest is. It runs before any check that could fail on one rank only, so a rank
        given another batch never leaves the others waiting in a collective.
        """
        mine = _batch_digest((args, kwargs, label))
        both = torch.cat([mine, -mine])
        with self._guard("the same-batch check"):
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.control)
        high, low = both[: mine.numel()], -both[mine.numel() :]
        if torch.equal(high, low):
            return
        what = "shapes, dtypes or structure" if high[0] != low[0] else "values"
        raise ConfigError(
            f"data parallel: the ranks were given different batches (their {what} differ; "
            f"seen on rank {self.rank} of {self.world}). forward_backward takes the global "
            "batch on every rank and keeps each rank's share of its rows; to give each rank "
            "its own shard instead (the DistributedDataParallel habit), pass "
            "RoundPipeRunConfig(batch_is_global=False) as model_run_config or run_config"
        )

    def reduce_loss(self, loss: Any) -> Any:
        """The sum of every rank's loss (a tensor, or a list of them), where it came from."""
        if loss is None:
            return None
        leaves = loss if isinstance(loss, list) else [loss]
        values = torch.stack([torch.as_tensor(x).detach().to("cpu", torch.float64) for x in leaves])
        with self._guard("the loss all-reduce"):
            dist.all_reduce(values, group=self.control)
        out = [
            v.to(x.dtype).to(x.device) if isinstance(x, torch.Tensor) else float(v)
            for v, x in zip(values, leaves, strict=True)
        ]
        return out if isinstance(loss, list) else out[0]

    # ---- the step (optimizer thread) -------------------------------------------------
    def publish_weights_take_grads(
        self, model: RoundPipeBase, *, hold_weights: bool = False
    ) -> None:
        """The data-parallel twin of roundpipe._publish_weights_take_grads; `hold_weights`
        (step_staleness=0): leave param_copied clear for `publish_in_order` after step_fn."""
        start = time.perf_counter()
        for attr, layout in zip(model.layer_attrs, self.layouts, strict=True):
            if model._optim_ahead:
                self._publish(layout)
            if not hold_weights or not layout.params:
                attr.param_copied.set()
        object.__setattr__(model, "_optim_ahead", False)
        published = time.perf_counter()
        self._reduce_grads(model, set_events=True)
        self.stats["steps"] += 1
        self.stats["publish_s"] += published - start
        self.stats["reduce_s"] += time.perf_counter() - published

    def progress(self, model: RoundPipeBase) -> PublishAsUpdated:
        """The StepProgress of a staleness-zero step: each layer gathered as updated."""
        return PublishAsUpdated(self, model)

    def publish_in_order(
        self, model: RoundPipeBase, progress: PublishAsUpdated | None = None
    ) -> None:
        """After step_fn (step_staleness=0, collective): publish every layer's new weights
        that `progress` did not publish while step_fn ran, layer 0 first, setting its
        param_copied as it lands."""
        if progress is None:
            progress = PublishAsUpdated(self, model)
        progress.publish_through(len(self.layouts) - 1)
        object.__setattr__(model, "_optim_ahead", False)

    def sync_optim_param(self, model: RoundPipeBase) -> None:
        """Bring every rank's model parameters to the latest weights (collective)."""
        if not model._optim_ahead:
            return
        for layout in self.layouts:
            self._publish(layout)
        object.__setattr__(model, "_optim_ahead", False)

    def synchronize(self, model: RoundPipeBase) -> None:
        """RoundPipe.synchronize across ranks: latest weights, `.grad` the global gradients."""
        synchronize_optim()
        self.sync_optim_param(model)
        self._reduce_grads(model, set_events=False)
        for layout in self.layouts:
            if self.sharded:
                grads = self._gather_full(layout, lambda span, pa: pa.optim.grad)
            else:
                grads = [pa.optim.grad for _, pa, _ in layout.params]  # type: ignore[union-attr]
            for (p, _, _), g in zip(layout.params, grads, strict=True):
                p.grad = None if g is None else g.detach().to(p.dtype, copy=True)

    def _pending_flags(self, layouts: list[_LayerLayout] | None = None) -> list[list[bool]]:
        """Per layer (of `layouts`, default all) and parameter: whether any rank holds a
        gradient not yet folded (collective)."""
        layouts = self.layouts if layouts is None else layouts
        flat = [
            float(pa.grad_pending and pa.grad_host is not None)
            for layout in layouts
            for _, pa, _ in layout.params
        ]
        flags = torch.tensor(flat or [0.0], dtype=torch.float32, device=self.device)
        with self._guard("the gradient flags all-reduce"):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.bulk)
        values = flags.tolist()
        out, k = [], 0
        for layout in layouts:
            out.append([v > 0 for v in values[k : k + len(layout.params)]])
            k += len(layout.params)
        return out

    def reduce_ahead(
        self, wait_grads: Callable[[nn.Parameter], None], stats: dict[str, float]
    ) -> None:
        """While a call's backward runs (engine.fold_ahead, on the optimizer thread): per
        layer, the last first, wait until this call's gradients of it are down
        (`wait_grads`), then sum them across ranks into the optimizer-side gradients, as
        the step's reduction would. Every rank takes the layers in this order, so the
        collectives meet. What is reduced here is no longer pending: the step's reduction
        skips it, and a second call before the step (accumulation) downloads afresh and is
        reduced by its own kernel, added to the sum kept in fp32."""
        for layout in reversed(self.layouts):
            if not layout.params:
                continue
            for p, _, _ in layout.params:
                wait_grads(p)
            start = time.perf_counter()
            (flags,) = self._pending_flags([layout])
            if any(flags):
                self._reduce_layer(layout, flags)
                stats["params"] += sum(flags)
                if _sumsq.can_keep():  # grad_norm's sums, taken here off the step's path
                    grads = [pa.optim.grad for _, pa, _ in layout.params if pa.optim is not None]
                    _sumsq.keep([g for g in grads if g is not None])
            took = time.perf_counter() - start
            stats["fold_s"] += took
            self.stats["reduce_s"] += took

    def _reduce_grads(self, model: RoundPipeBase, *, set_events: bool) -> None:
        flags = self._pending_flags()
        for index in self.reduce_order:
            layout = self.layouts[index]
            if any(flags[index]):
                self._reduce_layer(layout, flags[index])
            if set_events:
                model.layer_attrs[index].grad_copied.set()

    def _on_device(self) -> contextlib.AbstractContextManager[Any]:
        return (
            torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        )

    def _reduce_layer(self, layout: _LayerLayout, flags: list[bool]) -> None:
        """Sum the layer's gradients across ranks into the optimizer-side gradients."""
        size = layout.seg_len * (self.world if self.sharded else 1)
        with self._on_device(), self._guard("the gradient reduction"):
            buf = torch.zeros(size, dtype=layout.dtype, device=self.device)
            for span in layout.spans:
                _, pa, _ = layout.params[span.param]
                if pa.grad_pending and pa.grad_host is not None:
                    src = pa.grad_host.view(-1)[span.start : span.stop]
                    buf[span.seg : span.seg + span.stop - span.start].copy_(src, non_blocking=True)
            if self.sharded:
                out = torch.empty(layout.seg_len, dtype=layout.dtype, device=self.device)
                _reduce_scatter_flat(out, buf, group=self.bulk)
                base = self.rank * layout.seg_len
            else:
                dist.all_reduce(buf, group=self.bulk)
                out, base = buf, 0
            if self.stream is not None:
                # Down in the model dtype into pinned memory (fast, half the bytes); the
                # widening to fp32 happens on the host, as the single-process fold does.
                host = self._staging_buffer(out.numel(), out.dtype)
                host.copy_(out, non_blocking=True)
                self.stream.synchronize()  # grad_host read: the next download may overwrite it
                out = host
        for _, pa, _ in layout.params:
            pa.grad_pending = False
        for span in layout.mine:
            if not flags[span.param]:
                continue
            _, pa, _ = layout.params[span.param]
            target = pa.optim
            assert target is not None
            lo = span.seg - base
            g = out[lo : lo + span.stop - span.start].view(target.shape)
            if target.grad is None:
                # Reused across steps: a fresh fp32 buffer per step page-faults each time.
                held = self._grad_buffers.get(id(target))
                if held is None or held.shape != target.shape:
                    held = torch.empty(target.shape, dtype=target.dtype)
                    self._grad_buffers[id(target)] = held
                held.copy_(g)
                target.grad = held
            else:
                target.grad.add_(g)

    def _staging_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        held = self._staging.get(dtype)
        if held is None or held.numel() < numel:
            held = torch.empty(numel, dtype=dtype, pin_memory=self.stream is not None)
            self._staging[dtype] = held
        return held[:numel]

    def _publish(self, layout: _LayerLayout) -> None:
        """Copy the latest weights of the layer into the model's parameters."""
        if not self.sharded:
            for p, pa, _ in layout.params:
                p.data.copy_(pa.optim.data)  # type: ignore[union-attr]
            return
        seg = self._staging_buffer(layout.seg_len, layout.dtype)
        base = self.rank * layout.seg_len
        for span in layout.mine:
            _, pa, _ = layout.params[span.param]
            lo = span.seg - base
            # fp32 -> model dtype here, as the single-process publish rounds (p.copy_(master)).
            seg[lo : lo + span.stop - span.start].copy_(pa.optim.detach().reshape(-1))  # type: ignore[union-attr]
        with self._on_device(), self._guard("the weight all-gather"):
            mine = seg.to(self.device, non_blocking=True)
            out = torch.empty(layout.seg_len * self.world, dtype=layout.dtype, device=self.device)
            _all_gather_flat(out, mine, group=self.bulk)
            for span in layout.spans:
                p, _, _ = layout.params[span.param]
                dst = p.data.view(-1)[span.start : span.stop]
                dst.copy_(out[span.seg : span.seg + span.stop - span.start], non_blocking=True)
            if self.stream is not None:
                self.stream.synchronize()

    def _gather_full(
        self,
        layout: _LayerLayout,
        fetch: Callable[[_Span, ParamAttribute], torch.Tensor | None],
        dtype: torch.dtype = torch.float32,
    ) -> list[torch.Tensor | None]:
        """Full tensors of the layer's parameters from every rank's pieces (`fetch` gives a
        piece's tensor, or None); None for a parameter whose pieces all gave None."""
        n = len(layout.params)
        seg = torch.zeros(layout.seg_len, dtype=dtype)
        present = torch.zeros(self.world * n or 1)  # (rank, param): that rank gave a piece
        base = self.rank * layout.seg_len
        for span in layout.mine:
            _, pa, _ = layout.params[span.param]
            t = fetch(span, pa)
            if t is not None:
                lo = span.seg - base
                seg[lo : lo + span.stop - span.start].copy_(t.detach().reshape(-1))
                present[self.rank * n + span.param] = 1.0
        with self._on_device(), self._guard("a gather of full tensors"):
            out = torch.empty(layout.seg_len * self.world, dtype=dtype, device=self.device)
            _all_gather_flat(out, seg.to(self.device), group=self.bulk)
            present = present.to(self.device)
            dist.all_reduce(present, group=self.bulk)
            out, present = out.cpu(), present.cpu()
        full: list[torch.Tensor | None] = []
        for i, (p, _, _) in enumerate(layout.params):
            given = bool((present[i::n][: self.world] > 0).any()) if n else False
            full.append(torch.empty(p.numel(), dtype=dtype) if given else None)
        for span in layout.spans:
            f = full[span.param]
            if f is not None:
                f[span.start : span.stop].copy_(out[span.seg : span.seg + span.stop - span.start])
        return [
            None if f is None else f.view(p.shape)
            for f, (p, _, _) in zip(full, layout.params, strict=True)
        ]

    def all_reduce_scalar(
        self, value: float, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> float:
        """The sum (or `op`) over ranks of a float, on the bulk group (optimizer thread or
        idle).

        The value goes up, is reduced and comes down on the collective's stream: NCCL orders
        its kernel after the current stream only, so a tensor written on another stream (the
        thread's default one) could be read before its copy landed, and read back before the
        reduction finished; the NCCL ranks' gradient norm was one rank's share then.
        """
        with self._on_device(), self._guard("a scalar all-reduce"):
            t = torch.tensor([value], dtype=torch.float64).to(self.device)
            dist.all_reduce(t, op=op, group=self.bulk)
            return float(t.cpu())

    def barrier(self) -> None:
        with self._guard("a barrier"):
            dist.barrier(group=self.control)


# ---- helpers for a step_fn ----------------------------------------------------------
def grad_norm(model: RoundPipeBase, norm_type: float = 2.0) -> float:
    """The global gradient norm over every rank's optimizer-side gradients.

    Call it inside a step_fn (on the optimizer thread), on every rank, e.g. to clip:
    `scale = min(1, max_norm / (grad_norm(rp) + 1e-6))`, then `g.mul_(scale)` for each
    gradient. Without data parallel, the norm of the local gradients.
    """
    dp: DataParallel | None = getattr(model, "_dp", None)
    if dp is not None and not dp.sharded:
        dp = None  # replicated state: every rank already holds the global gradients
    grads = [p.grad for p in model.optim_parameters() if p.grad is not None]
    if math.isinf(norm_type):
        local = max((float(g.abs().max()) for g in grads), default=0.0)
        if dp is None:
            return local
        return dp.all_reduce_scalar(local, dist.ReduceOp.MAX)
    summable = all(g.device.type == "cpu" and g.dtype in _sumsq.GRAD_DTYPES for g in grads)
    if norm_type == 2.0 and summable and _sumsq.can_keep():
        # The C library's sums, in double on every core, kept where the reduction during
        # the backward took them (reduce_ahead): with staleness zero the norm is on the
        # step's path, and a double copy of every fp32 gradient was the slow way there.
        local = _sumsq.total(grads)
    else:
        local = sum(float(g.double().norm(norm_type) ** norm_type) for g in grads)
    total = local if dp is None else dp.all_reduce_scalar(local)
    return total ** (1.0 / norm_type)
