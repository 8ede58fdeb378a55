"""engine.batch's row splits: even counts, row bounds of multi-row items, the split_input
callable cutting on them (DPO's pairs and the worker's sampling use these)."""

from __future__ import annotations

import pytest
import torch

from engine.batch import even_counts, row_bounds, split_rows
from engine.errors import ConfigError, SplitError


@pytest.mark.parametrize(
    ("items", "parts", "want"),
    [(7, 3, [3, 2, 2]), (2, 5, [1, 1]), (1, 1, [1]), (9, 3, [3, 3, 3]), (5, 0, [5])],
)
def test_even_counts(items: int, parts: int, want: list[int]) -> None:
    assert even_counts(items, parts) == want


def test_even_counts_refuses_an_empty_batch() -> None:
    with pytest.raises(ConfigError, match="at least one item"):
        even_counts(0, 3)


def test_row_bounds_of_pairs() -> None:
    assert row_bounds([2, 1]) == [(0, 2), (2, 3)]
    assert row_bounds([2, 1], rows_per_item=2) == [(0, 4), (4, 6)]


def test_split_rows_cuts_the_batch_tensors_only() -> None:
    ids = torch.arange(6 * 3).reshape(6, 3)
    mask = torch.ones(4)  # not 6 rows: every micro-batch gets it whole
    split = split_rows(row_bounds([2, 1], rows_per_item=2))
    (a_args, a_kwargs), (b_args, b_kwargs) = split((ids,), {"mask": mask, "flag": True}, 2)
    assert torch.equal(a_args[0], ids[:4]) and torch.equal(b_args[0], ids[4:])
    assert a_kwargs["mask"] is mask and b_kwargs["flag"] is True
    with pytest.raises(SplitError, match="2 micro-batches"):
        split((ids,), {}, 3)
