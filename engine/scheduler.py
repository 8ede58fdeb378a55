"""Which layer groups run, in what order: execution plans, the tracker, the backward rotation.

`ModelExecutePlan.auto` measures (or estimates) per-layer costs and hands them to the plan
search in engine.planning.search, which ranks plans on engine.planning.simulate.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from .device import get_num_devices
from .errors import ConfigError
from .planning.search import group_param_cap, plan_groups
from .planning.simulate import DEFAULT_PUBLISH_MS_PER_GB
from .threads import AnnotatedSemaphore
from .timer import ModelTimer

if TYPE_CHECKING:
    from .roundpipe import RoundPipe

__all__ = [
    "BackwardScheduleSimulator",
    "ModelExecutePlan",
    "ModelTracker",
    "RunType",
    "chunk_layer_params",
    "plan_from_times",
]

log = logging.getLogger(__name__)

RunType = Literal["infer", "train", "fused"]


class ModelExecutePlan:
    """Layer groups for forward (`fwd_plan`) and backward (`bwd_plan`).

    `fwd_plan` lists ascending ranges covering every layer in order. `bwd_plan` lists the
    backward groups in execution order (last layers first), each range ascending:
    - 'infer': no backward; `bwd_plan` is empty;
    - 'train' (forward, then backward through autograd): `bwd_plan` covers every layer;
    - 'fused' (forward_backward): the last forward group runs forward and backward in one
      job, so `bwd_plan` covers the layers before it.

    `tail_split` (fused only) spreads that fused tail over several jobs on consecutive
    devices, job s taking micro-batches s, s + tail_split, ...: the tail (the head with its
    loss, the longest job of a step: bench/RESULTS.md) is then no longer one job that is
    longer than a GPU's share of the step when there are many GPUs. Results are the same;
    the tail's parameter gradients are summed over its jobs.
    """

    def __init__(self) -> None:
        self.fwd_plan: list[range] = []
        self.bwd_plan: list[range] = []
        self.tail_split = 1

    def __repr__(self) -> str:
        def fmt(plan: list[range]) -> str:
            return "[" + ", ".join(f"{r.start}-{r.stop - 1}" for r in plan) + "]"

        split = f", tail_split={self.tail_split}" if self.tail_split != 1 else ""
        return f"ModelExecutePlan(fwd={fmt(self.fwd_plan)}, bwd={fmt(self.bwd_plan)}{split})"

    @classmethod
    def from_ranges(
        cls, fwd_plan: Sequence[range], bwd_plan: Sequence[range] = (), tail_split: int = 1
    ) -> ModelExecutePlan:
        """A plan from explicit ranges (and the number of jobs of the fused tail)."""
        plan = cls()
        plan.fwd_plan = list(fwd_plan)
        plan.bwd_plan = list(bwd_plan)
        plan.tail_split = tail_split
        return plan

    @classmethod
    def grouped(cls, num_layers: int, layers_per_group: int) -> ModelExecutePlan:
        """Groups of `layers_per_group` consecutive layers for forward and backward, the
        last group (with the head) being the fused tail.

        Each backward group keeps its input in host memory per micro-batch for the
        recompute, so larger groups keep fewer (the automatic plan makes one-layer groups
        where a layer weighs about as much as the head: a 70B model) and upload more
        weights at once to the GPU (two groups are in flight).
        """
        if isinstance(layers_per_group, bool) or not isinstance(layers_per_group, int):
            raise ConfigError(f"layers_per_group must be an int, got {layers_per_group!r}")
        if layers_per_group < 1 or num_layers < 1:
            raise ConfigError(
                f"layers_per_group and num_layers must be >= 1, got {layers_per_group} "
                f"and {num_layers}"
            )
        fwd = [
            range(a, min(a + layers_per_group, num_layers))
            for a in range(0, num_layers, layers_per_group)
        ]
        return cls.from_ranges(fwd, list(reversed(fwd[:-1])))

    def check_valid(self, num_layers: int, run_type: RunType) -> None:
        """Raise ConfigError unless the plans cover the layers exactly once, in order."""
        if not self.fwd_plan:
            raise ConfigError("execute_plan.fwd_plan is empty")
        split = self.tail_split
        if isinstance(split, bool) or not isinstance(split, int) or split < 1:
            raise ConfigError(f"execute_plan.tail_split must be an int >= 1, got {split!r}")
        _check_cover(self.fwd_plan, 0, num_layers, "fwd_plan", ascending=True)
        if run_type == "infer":
            return
        stop = num_layers if run_type == "train" else self.fwd_plan[-1].start
        if stop == 0:
            if self.bwd_plan:
                raise ConfigError(
                    "execute_plan.bwd_plan must be empty when one fused group covers all layers"
                )
            return
        _check_cover(list(reversed(self.bwd_plan)), 0, stop, "bwd_plan", ascending=True)

    @classmethod
    def auto(
        cls,
        run_type: RunType,
        /,
        *models: RoundPipe,
        min_stages: int | None = None,
        upper_threshold: float = 1.1,
        model_memory_limit: float | None = None,
        num_microbatch: int | None = None,
        overlap: bool = False,
        by_size: bool = False,
        fixed_tail: tuple[int | None, int] | None = None,
    ) -> ModelExecutePlan:
        """A plan balanced on the models' measured (or size-estimated) layer times.

        Stages are grown greedily up to `upper_threshold` times the slowest layer, lowered
        until there are at least `min_stages` (default: the number of devices), and no
        stage holds more than `model_memory_limit / 2` GB of parameters (default: 60% of
        the smallest device's free memory), since the next stage is prefetched. With
        'fused' and more than one stage wanted, backward groups grow up to the fused
        tail's cost instead, so no device waits on a slower stage before it; and given
        measured times and `num_microbatch`, the group boundaries are then moved to where
        a simulation of the round-robin pipeline finishes the call soonest (short groups
        first and last fill and drain the pipeline faster; see engine.planning.search), and
        the fused tail is split over the number of jobs (`tail_split`, at most one per
        device) whose simulated call is shortest (with `overlap`, the shortest time between
        overlapped calls: RoundPipe overlap_calls). With `by_size`, the sizes stand for the
        times even once measured (one GPU: engine.planning.one_device). See `plan_from_times`.

        A split tail sums its layers' gradients in parts, so where the tail is split, its
        split and its first layer are chosen from the layer sizes, not the measured times
        (or given as `fixed_tail`: first layer or None, split): two identical runs then get the
        same sums, bit for bit, however their timings differ; the groups below the tail,
        which change no sum, follow the times.
        """
        if not models:
            raise ConfigError("ModelExecutePlan.auto needs at least one RoundPipe model")
        n = models[0].num_layers
        if any(m.num_layers != n for m in models):
            raise ConfigError(
                "ModelExecutePlan.auto: the models must have the same number of layers"
            )
        if min_stages is None:
            min_stages = get_num_devices()
        fwd = [0.0] * n
        bwd = [0.0] * n
        mem = [0.0] * n
        measured = True
        for m in models:
            timer = m.model_timer
            source, f, b = timer.size_estimate() if by_size else timer.get_estimate(run_type)
            measured = measured and source == "time"
            for i in range(n):
                fwd[i] += f[i]
                bwd[i] += b[i]
                mem[i] += m.layer_size[i]
        publish = None
        if overlap:
            ms_per_gb = (
                models[0].publish_ms_per_gb() if hasattr(models[0], "publish_ms_per_gb") else None
            )
            publish = [g * (ms_per_gb or DEFAULT_PUBLISH_MS_PER_GB) for g in mem]
        # Fewer than 3 devices never split the tail.
        searched = run_type == "fused" and measured and min_stages >= 3
        if fixed_tail is None and searched and num_microbatch:
            work = [0.0] * n
            for m in models:
                work = [a + b for a, b in zip(work, _work_sizes(m), strict=True)]
            fixed_tail = _tail_by_size(
                work, mem, min_stages, num_microbatch, upper_threshold, model_memory_limit, overlap
            )
        return plan_from_times(
            run_type,
            fwd,
            bwd,
            mem,
            num_devices=min_stages,
            num_microbatch=num_microbatch if measured else None,
            upper_threshold=upper_threshold,
            mem_cap=group_param_cap(model_memory_limit),
            overlap=overlap,
            publish=publish,
            fixed_tail=fixed_tail,
        )


def _work_sizes(model: Any) -> list[float]:
    """Per layer, the GB of parameters its forward multiplies with: the layer's size less
    what only embedding lookups read (an embedding layer costs a lookup, not a matmul; a
    head tied to it multiplies with the same weight and keeps it). A static stand-in for
    the layers' times."""
    layers = getattr(model, "layers", None)
    if layers is None:
        return list(model.layer_size)
    sizes = []
    for layer in layers:
        looked_up = {
            id(p)
            for mod in layer.modules()
            if isinstance(mod, torch.nn.Embedding)
            for p in mod.parameters(recurse=False)
        }
        multiplied = {
            id(p): p
            for mod in layer.modules()
            if not isinstance(mod, torch.nn.Embedding)
            for p in mod.parameters(recurse=False)
        }
        numel_bytes = sum(
            p.numel() * p.element_size() for i, p in multiplied.items() if i not in looked_up
        )
        sizes.append(numel_bytes / 1e9)
    return sizes


def _tail_by_size(
    work: list[float],
    mem: list[float],
    num_devices: int,
    num_microbatch: int,
    upper_threshold: float,
    model_memory_limit: float | None,
    overlap: bool,
) -> tuple[int | None, int]:
    """The fused tail (first layer, or None where any will do; split) of the plan whose
    layer times are their `work` sizes: what measured times may not change."""
    # The floor keeps a layer of no weights (an embedding) from costing nothing at all.
    floor = max(work) / 100 if work and max(work) > 0 else 1.0
    fwd = [max(w, floor) for w in work]
    groups = plan_groups(
        "fused",
        fwd,
        [f * ModelTimer.BACKWARD_MULTIPLIER for f in fwd],
        mem,
        num_devices=num_devices,
        num_microbatch=num_microbatch,
        upper_threshold=upper_threshold,
        mem_cap=group_param_cap(model_memory_limit),
        overlap=overlap,
    )
    # An unsplit tail may start anywhere: its extent changes no sum.
    split = groups.tail_split
    return (groups.fwd_plan[-1].start if split > 1 else None, split)


def plan_from_times(
    run_type: RunType,
    fwd: Sequence[float],
    bwd: Sequence[float],
    mem: Sequence[float],
    *,
    num_devices: int,
    num_microbatch: int | None = None,
    upper_threshold: float = 1.1,
    mem_cap: float = float("inf"),
    overlap: bool = False,
    publish: Sequence[float] | None = None,
    fixed_tail: tuple[int | None, int] | None = None,
) -> ModelExecutePlan:
    """`ModelExecutePlan.auto` on given per-layer costs and sizes: the groups of
    `engine.planning.search.plan_groups` (its arguments), checked. bench/simulate.py
    plans hypothetical machines with it."""
    groups = plan_groups(
        run_type,
        fwd,
        bwd,
        mem,
        num_devices=num_devices,
        num_microbatch=num_microbatch,
        upper_threshold=upper_threshold,
        mem_cap=mem_cap,
        overlap=overlap,
        publish=publish,
        fixed_tail=fixed_tail,
    )
    plan = ModelExecutePlan.from_ranges(groups.fwd_plan, groups.bwd_plan, groups.tail_split)
    plan.check_valid(len(fwd), run_type)
    return plan


def _check_cover(plan: list[range], start: int, stop: int, what: str, *, ascending: bool) -> None:
    pos = start
    for r in plan:
        if not isinstance(r, range) or r.step != 1 or r.start != pos or r.stop <= r.start:
            raise ConfigError(
                f"execute_plan.{what} must be contiguous non-empty ranges covering layers "
                f"{start}..{stop - 1} exactly once, got {plan}"
            )
        pos = r.stop
    if pos != stop:
        raise ConfigError(
            f"execute_plan.{what} must cover layers {start}..{stop - 1} exactly once, got {plan}"
        )


class ModelTracker:
    """Counters that let a group start micro-batch i once the group before it finished it."""

    def __init__(
        self,
        execute_plan: ModelExecutePlan,
        num_layers: int | None = None,
        recompute_grain: str = "stage",
    ) -> None:
        self.fwd_plan = execute_plan.fwd_plan
        self.bwd_plan = execute_plan.bwd_plan
        self.fwd_sem = [AnnotatedSemaphore(f"fwd_group{g}.done") for g in range(len(self.fwd_plan))]
        self.bwd_sem = [AnnotatedSemaphore(f"bwd_group{g}.done") for g in range(len(self.bwd_plan))]
        self.fused_fwd_sem = AnnotatedSemaphore("fused.forward_done")
        if recompute_grain == "layer":
            if num_layers is None:
                num_layers = max((r.stop for r in execute_plan.fwd_plan), default=0)
            self._need_input = set(range(num_layers))
        else:
            self._need_input = {r.start for r in self.bwd_plan}

    def backward_need_input(self, layer_id: int) -> bool:
        """Whether the backward re-runs from this layer's input (so forward keeps it)."""
        return layer_id in self._need_input

    def forward_notify(self, layer_group_id: int) -> None:
        """A forward group finished one more micro-batch."""
        self.fwd_sem[layer_group_id].release()

    def backward_notify(self, layer_group_id: int) -> None:
        """A backward group finished one more micro-batch."""
        self.bwd_sem[layer_group_id].release()

    def fused_forward_notify(self) -> None:
        """The fused group finished the forward part of one more micro-batch."""
        self.fused_fwd_sem.release()


class BackwardScheduleSimulator:
    """Keeps the device rotation going across backward jobs launched by autograd.

    Backward groups run on the next devices in the same round-robin as forward, so a
    backward launched later by autograd continues where the forward left off; `reset`
    starts a fresh rotation.
    """

    def __init__(self) -> None:
        self.n_devices = get_num_devices()
        self.cur_device = 0
        self.tags = [torch.zeros(()) for _ in range(self.n_devices)]

    def get_next_tag(self) -> torch.Tensor:
        """The tag of the next device in rotation."""
        tag = self.tags[self.cur_device]
        self.cur_device = (self.cur_device + 1) % self.n_devices
        return tag

    def update_current_tag(self, new_tag: torch.Tensor) -> None:
        """Remember the tag produced by the latest backward."""
        self.tags[(self.cur_device - 1) % self.n_devices] = new_tag

    def reset(self) -> None:
        """Start a new rotation."""
        self.cur_device = 0


def chunk_layer_params(
    tensor_pair: list[tuple[torch.Tensor, torch.Tensor]], n_chunks: int
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Spread copy work over `n_chunks` with the greedy largest-first partition."""
    chunks: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(max(1, n_chunks))]
    load = [0] * len(chunks)
    for pair in sorted(tensor_pair, key=lambda p: -p[0].numel() * p[0].element_size()):
        i = load.index(min(load))
        chunks[i].append(pair)
        load[i] += pair[0].numel() * pair[0].element_size()
    return chunks
