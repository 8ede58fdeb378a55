"""engine.batch.Batch, the seeds' flattened micro-batch state: what RoundPipe splits a call
into and merges its outputs from."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

from engine.batch import Batch, RoundPipePackedData, avg_reducer
from engine.errors import ConfigError
from engine.run_config import FullRoundPipeRunConfig, RoundPipeRunConfig


def _cfg(**kwargs: object) -> FullRoundPipeRunConfig:
    return FullRoundPipeRunConfig(RoundPipeRunConfig(**kwargs), RoundPipeRunConfig(), num_devices=1)


def test_a_batch_splits_inputs_and_labels_into_micro_batches() -> None:
    x = torch.arange(12.0).view(6, 2).requires_grad_()
    mask = torch.ones(3)  # not of the batch size: every micro-batch gets it whole
    label = torch.arange(6)
    batch = Batch((x,), {"mask": mask, "scale": 2}, _cfg(num_microbatch=3), label)

    assert batch.num_microbatch == 3 and batch.batch_size == 6
    assert len(batch.flatten_states) == len(batch.flatten_specs) == 3
    first = batch.flatten_states[0]
    assert torch.equal(first[0], x[:2]) and first[1] is mask and first[2] == 2
    assert batch.requires_grad == [True, False, False]
    assert [lab.tolist() for lab in batch.label_list] == [[0, 1], [2, 3], [4, 5]]
    assert isinstance(batch.split_specs[0], TensorChunkSpec)
    assert batch.split_specs[1] is _Replicate
    assert batch.loss_list == [] and batch.loss_ready is None
    assert batch.forward_events == [(), (), ()] and batch.backward_events == [(), (), ()]


def test_dump_merges_the_stored_outputs_by_the_run_config() -> None:
    batch = Batch((torch.zeros(4, 1),), {}, _cfg(num_microbatch=2))
    batch.store_outputs(
        [(torch.ones(2, 3), torch.tensor(1.0)), (torch.zeros(2, 3), torch.tensor(3.0))]
    )

    out, loss = batch.dump(_cfg(merge_output=(TensorChunkSpec(0), avg_reducer)))
    assert out.shape == (4, 3) and out[:2].eq(1).all() and out[2:].eq(0).all()
    assert loss.item() == 2.0
    packed = batch.dump(_cfg(merge_output=False))
    assert isinstance(packed, RoundPipePackedData) and len(packed) == 2
    with pytest.raises(ValueError, match="3 outputs for 2 micro-batches"):
        batch.store_outputs([1, 2, 3])


def test_a_packed_input_keeps_its_micro_batches_and_is_refused_among_others() -> None:
    packed = RoundPipePackedData([torch.ones(2, 2), torch.zeros(3, 2)])
    batch = Batch((packed,), {}, _cfg(num_microbatch=4))
    assert batch.num_microbatch == 2 and batch.batch_size is None and batch.split_specs is None
    assert batch.flatten_states[1][0].shape == (3, 2)
    with pytest.raises(ConfigError, match="only input"):
        Batch((packed, torch.ones(1)), {}, _cfg())


def test_a_custom_splitter_gives_no_chunk_specs() -> None:
    def halves(args: tuple, kwargs: dict, n: int) -> list:
        return [((a,), {}) for a in args[0].chunk(n)]

    batch = Batch((torch.arange(4.0),), {}, _cfg(num_microbatch=2, split_input=halves))
    assert batch.num_microbatch == 2 and batch.split_specs is None
    assert batch.flatten_states[1][0].tolist() == [2.0, 3.0]
