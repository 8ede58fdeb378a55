"""The staleness-zero step's publishing under data parallel: each layer gathered as the
optimizer finishes it (`PublishAsUpdated`, the StepProgress that
engine.parallel.data_parallel hands the step; engine.context defines the protocol)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..roundpipe_base import RoundPipeBase
    from .data_parallel import DataParallel

__all__ = ["PublishAsUpdated"]


class PublishAsUpdated:
    """The StepProgress (engine.context) of a staleness-zero step under data parallel: each
    layer's weights are gathered (sharded) or copied into the model as soon as the optimizer
    reports this rank's part of them updated, layer 0 first, so the next call's first layers
    start while the optimizer updates the later ones (the single-process step's
    `_LayerProgress` does the same without collectives).

    The gathers are collectives, so every rank takes the layers strictly in order: a layer
    goes out once its own part and every layer before it are done. A layer this rank holds
    no part of (or whose parameters got no gradient) goes out with the next one that
    completes, or after step_fn (`publish_in_order`); an optimizer that reports nothing
    (torch's) leaves every layer to that."""

    def __init__(self, dp: DataParallel, model: RoundPipeBase) -> None:
        self.dp = dp
        self.events = [attr.param_copied for attr in model.layer_attrs]
        self.layer_of: dict[int, int] = {}  # id(optimizer-side parameter) -> its layer
        self.left = [0] * len(dp.layouts)  # per layer, this rank's parts not yet reported
        for j, layout in enumerate(dp.layouts):
            for _, pa, _ in layout.params:
                if pa.optim is not None:
                    self.layer_of[id(pa.optim)] = j
                    self.left[j] += 1
        self.next = 0  # the first layer not yet published
        self.early = 0  # layers published while step_fn ran
        self.first_s: float | None = None

    def order(self, param: torch.Tensor) -> int:
        return self.layer_of.get(id(param), len(self.left))

    def updated(self, param: torch.Tensor) -> None:
        j = self.layer_of.get(id(param))
        if j is None:
            return
        self.left[j] -= 1
        if self.left[j] == 0 and j >= self.next:
            before = self.next
            self.publish_through(j)
            self.early += self.next - before
            if self.first_s is None:
                self.first_s = time.perf_counter()

    def publish_through(self, last: int) -> None:
        """Publish layers `next..last` in order (collective), releasing each."""
        start = time.perf_counter()
        while self.next <= last:
            layout = self.dp.layouts[self.next]
            if layout.params:
                self.dp._publish(layout)
            self.events[self.next].set()
            self.next += 1
        self.dp.stats["publish_s"] += time.perf_counter() - start

    def report(self, name: str, phases: dict[str, float], start: float) -> None:
        """The early publishing, into the step's phases (as _LayerProgress.report)."""
        phases["early_layers"] = float(self.early)
        if self.first_s is not None:
            phases["first_layer_s"] = self.first_s - start
