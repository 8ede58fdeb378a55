"""RoundPipeRunConfig: per-model and per-call run settings, and their merge."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, get_args

import torch

from .device import get_num_devices
from .errors import ConfigError
from .options import RecomputeGrain, default_num_microbatch
from .scheduler import ModelExecutePlan

__all__ = ["FullRoundPipeRunConfig", "RoundPipeRunConfig"]

_GRAINS = get_args(RecomputeGrain)


@dataclass(frozen=True, slots=True)  # positional too, in the seeds' order of arguments
class RoundPipeRunConfig:
    """Settings for running a RoundPipe model; None everywhere means "inherit".

    Given at model level (`RoundPipe(model_run_config=...)`) and/or per call
    (`forward(roundpipe_run_config=...)`, `forward_backward(run_config=...)`); a per-call
    value wins, and a value unset at both levels takes the built-in default.

    Attributes:
        requires_grad: Keep what backward needs. Default: torch's grad mode.
        output_device: Where merged outputs go. Default: the CPU.
        preserve_rng_state: Restore the RNG state in recompute so dropout matches.
            Default: True.
        recompute_grain: 'stage' (recompute a backward stage, then backward it) or
            'layer' (recompute and backward one layer at a time). Default: 'stage'.
        num_microbatch: Micro-batches per call. Default: number of devices + 1.
        split_input: How to split the inputs: a `(args_spec, kwargs_spec)` pair of
            `torch.distributed.pipelining.microbatch` chunk specs (TensorChunkSpec(dim) or
            _Replicate) mirroring the arguments, or a callable
            `(args, kwargs, num_microbatch) -> [(args_i, kwargs_i), ...]`. Default: automatic.
        split_label: The same for the label: a chunk-spec tree or a callable
            `(label, num_microbatch) -> [label_i, ...]`. Default: automatic.
        merge_output: How to merge micro-batch outputs: a chunk-spec tree, a callable
            `[out_i, ...] -> out`, True (automatic) or False (return a RoundPipePackedData
            that another RoundPipe model consumes without re-splitting). Default: automatic.
        execute_plan: A ModelExecutePlan. Default: ModelExecutePlan.auto from timings.
        output_fn: Forward without gradients only: `(output, micro_batch_index) -> output`
            applied on the device to each micro-batch's output of the last layer group,
            before its download (e.g. to reduce a head's output to a few numbers per
            sequence). Default: none.
        batch_is_global: Under data parallel (engine.parallel.data_parallel), whether
            `forward_backward` is given the global batch on every rank (True: each rank
            keeps its equal share of the rows, and the ranks check that they were given
            the same batch) or each rank's own shard (False, as with
            DistributedDataParallel: the inputs are used as given). Default: True.
    """

    requires_grad: bool | None = None
    output_device: torch.device | str | None = None
    preserve_rng_state: bool | None = None
    recompute_grain: RecomputeGrain | None = None
    num_microbatch: int | None = None
    split_input: Any = None
    split_label: Any = None
    merge_output: Any = None
    execute_plan: ModelExecutePlan | None = None
    output_fn: Callable[[Any, int], Any] | None = None
    batch_is_global: bool | None = None

    def __post_init__(self) -> None:
        if self.batch_is_global is not None and not isinstance(self.batch_is_global, bool):
            raise ConfigError(
                f"run_config.batch_is_global must be True or False, got {self.batch_is_global!r}"
            )
        if self.recompute_grain is not None and self.recompute_grain not in _GRAINS:
            raise ConfigError(
                f"run_config.recompute_grain must be 'stage' or 'layer', got {self.recompute_grain!r}"
            )
        if self.num_microbatch is not None and (
            isinstance(self.num_microbatch, bool)
            or not isinstance(self.num_microbatch, int)
            or self.num_microbatch < 1
        ):
            raise ConfigError(
                f"run_config.num_microbatch must be an int >= 1, got {self.num_microbatch!r}"
            )
        if self.output_device is not None:
            try:
                torch.device(self.output_device)
            except (RuntimeError, TypeError) as exc:
                raise ConfigError(
                    f"run_config.output_device must name a torch device, got {self.output_device!r}"
                ) from exc
        if self.execute_plan is not None and not isinstance(self.execute_plan, ModelExecutePlan):
            raise ConfigError(
                "run_config.execute_plan must be a ModelExecutePlan, "
                f"got {type(self.execute_plan).__name__}"
            )
        if self.output_fn is not None and not callable(self.output_fn):
            raise ConfigError(
                f"run_config.output_fn must be callable, got {type(self.output_fn).__name__}"
            )

    def over(self, base: RoundPipeRunConfig) -> RoundPipeRunConfig:
        """This config, with unset fields taken from `base`."""
        merged = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in merged.items():
            if value is None:
                merged[name] = getattr(base, name)
        return RoundPipeRunConfig(**merged)


class FullRoundPipeRunConfig:
    """A per-call config over a model-level config, with every default resolved.

    `FullRoundPipeRunConfig(function_run_config, model_run_config)`; the number of devices
    (for the default num_microbatch) is the engine's unless given.
    """

    __slots__ = (
        "batch_is_global",
        "execute_plan",
        "merge_output",
        "num_microbatch",
        "output_device",
        "output_fn",
        "preserve_rng_state",
        "recompute_grain",
        "requires_grad",
        "split_input",
        "split_label",
    )

    def __init__(
        self,
        function_run_config: RoundPipeRunConfig,
        model_run_config: RoundPipeRunConfig,
        *,
        num_devices: int | None = None,
    ) -> None:
        if num_devices is None:
            num_devices = get_num_devices()
        c = function_run_config.over(model_run_config)
        self.requires_grad: bool = (
            torch.is_grad_enabled() if c.requires_grad is None else c.requires_grad
        )
        self.output_device: torch.device = torch.device(c.output_device or "cpu")
        self.preserve_rng_state: bool = (
            True if c.preserve_rng_state is None else c.preserve_rng_state
        )
        self.recompute_grain: RecomputeGrain = c.recompute_grain or "stage"
        self.num_microbatch: int = c.num_microbatch or default_num_microbatch(num_devices)
        self.split_input: Any = c.split_input
        self.split_label: Any = c.split_label
        self.merge_output: Any = True if c.merge_output is None else c.merge_output
        self.execute_plan: ModelExecutePlan | None = c.execute_plan
        self.output_fn: Callable[[Any, int], Any] | None = c.output_fn
        self.batch_is_global: bool = True if c.batch_is_global is None else c.batch_is_global

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__)
        return f"FullRoundPipeRunConfig({inner})"


SplitFn = Callable[..., list[Any]]
