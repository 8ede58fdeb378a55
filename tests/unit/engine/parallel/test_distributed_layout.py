"""The ZeRO-1 shard layout of engine.parallel.data_parallel, without processes: every element of a
layer lands in exactly one rank's range, cut on row boundaries, balanced to a row."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.errors import ConfigError
from engine.parallel.data_parallel import (
    AUTO_GROUP,
    _bulk_backend,
    _LayerLayout,
    _piece_shape,
    resolve_process_group,
)


class _Attr:
    optim = None


def _layout(shapes: list[tuple[int, ...]], world: int, rank: int) -> _LayerLayout:
    params = [(nn.Parameter(torch.zeros(s)), _Attr(), f"p{i}") for i, s in enumerate(shapes)]
    return _LayerLayout(params, world, rank, sharded=True)  # type: ignore[arg-type]


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_every_element_in_exactly_one_rank_on_row_boundaries(world: int) -> None:
    shapes = [(17, 5), (17,), (13, 17), (1,), (3, 2, 7), ()]
    layout = _layout(shapes, world, rank=0)
    params = [p for p, _, _ in layout.params]
    covered = [torch.zeros(p.numel(), dtype=torch.int32) for p in params]
    per_rank = [0] * world
    for span in layout.spans:
        p = params[span.param]
        row = p.numel() // p.shape[0] if p.dim() else 1
        assert span.start % row == 0 and span.stop % row == 0  # whole rows only
        covered[span.param][span.start : span.stop] += 1
        per_rank[span.rank] += span.stop - span.start
        assert (
            0 <= span.seg - span.rank * layout.seg_len <= layout.seg_len - (span.stop - span.start)
        )
        assert _piece_shape(p, span) == (
            ((span.stop - span.start) // row, *p.shape[1:]) if p.dim() else ()
        )
    for c in covered:
        assert torch.equal(c, torch.ones_like(c))
    total = sum(p.numel() for p in params)
    widest_row = max(p.numel() // p.shape[0] if p.dim() else 1 for p in params)
    assert max(per_rank) - min(per_rank) <= 2 * widest_row  # balanced to about a row
    assert max(per_rank) <= layout.seg_len
    assert sum(per_rank) == total


def test_each_rank_sees_its_own_spans() -> None:
    shapes = [(40, 3), (9,)]
    mine = [_layout(shapes, 3, r).mine for r in range(3)]
    assert all(s.rank == r for r, spans in enumerate(mine) for s in spans)
    assert sum(len(m) for m in mine) == len(_layout(shapes, 3, 0).spans)


def test_single_process_without_a_group() -> None:
    # Nothing initialised: the default stays single-process, an explicit group is an error.
    assert resolve_process_group(AUTO_GROUP) is None
    assert resolve_process_group(None) is None
    with pytest.raises(ConfigError, match="init_process_group"):
        resolve_process_group(object())


@pytest.mark.parametrize(
    ("group", "gpus", "bulk"),
    [
        ("nccl", True, "nccl"),
        ("gloo", True, "gloo"),
        ("gloo", False, "gloo"),
        # init_process_group() without a backend on a CUDA build (the multi-node rank)
        ("cpu:gloo,cuda:nccl", True, "nccl"),
        ("cpu:gloo,cuda:nccl", False, "gloo"),
        # init_process_group() with no backend at all: torch reports "undefined"
        ("undefined", True, "nccl"),
        ("undefined", False, "gloo"),
    ],
)
def test_the_bulk_group_takes_one_backend(
    monkeypatch: pytest.MonkeyPatch, group: str, gpus: bool, bulk: str
) -> None:
    from types import SimpleNamespace

    from engine.parallel import data_parallel

    devices = [SimpleNamespace(is_cuda=gpus)]
    monkeypatch.setattr(data_parallel, "get_devices", lambda: devices)
    assert _bulk_backend(group) == bulk
