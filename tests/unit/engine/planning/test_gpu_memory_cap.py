"""The GPU memory cap (RoundPipe max_gpu_memory, RP_GPU_MEMORY_GIB): parsed, refused below
the layers' floor, and counted by the plan's group sizes and the fused tail's widening.

Oracles: the plan rules' arithmetic by hand (a group holds at most 30% of the capped memory
in parameters; the widened tail stays within 90% of the cap less the peak reserved).
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from engine import ModelExecutePlan, RoundPipe
from engine.device import (
    device_memory_bytes,
    get_min_gpu_memory,
    gpu_memory_cap_bytes,
    set_gpu_memory_cap,
)
from engine.errors import ConfigError
from engine.planning import one_device
from engine.planning.gpu_memory import (
    WORKSPACE_BYTES,
    check_gpu_memory_cap,
    min_gpu_memory_bytes,
    parse_max_gpu_memory,
)
from engine.planning.one_device import ActivationMeter, DeviceRoom, widen_tail
from engine.timer import ModelTimer
from tests.unit.engine.conftest import use_devices

GIB = 1 << 30
MIB = 1 << 20

# An embedding and a head of 0.3 GB around 28 decoder layers of 0.1 GB (Qwen3-1.7B's shape).
LAYER_GB = [0.3] + [0.1] * 28 + [0.3]
# Its default fused plan on one device: the top backward group holds layers 23-28.
PLAN = ModelExecutePlan.from_ranges(
    [range(0, 7), range(7, 13), range(13, 19), range(19, 25), range(25, 29), range(29, 30)],
    [range(23, 29), range(17, 23), range(11, 17), range(5, 11), range(0, 5)],
)


@pytest.fixture
def cpu1() -> Iterator[int]:
    yield from use_devices("cpu:1", 1)


def sized_model() -> SimpleNamespace:
    timer = ModelTimer([g * 1e9 for g in LAYER_GB])
    return SimpleNamespace(num_layers=len(LAYER_GB), layer_size=LAYER_GB, model_timer=timer)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (24, 24 * GIB),
        (23.5, int(23.5 * GIB)),
        ("24", 24 * GIB),
        ("24GiB", 24 * GIB),
        ("512MiB", 512 * MIB),
        ("20G", 20 * 10**9),
        (None, None),
        (24 * GIB, 24 * GIB),  # a number of bytes (from 2**20 up) is bytes
        (str(24 * GIB), 24 * GIB),
        ((1 << 20) - 1, ((1 << 20) - 1) * GIB),
    ],
)
def test_parse_reads_numbers_as_gib_and_strings_with_units(value, expected) -> None:
    assert parse_max_gpu_memory(value) == expected


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), True, "lots", "0GiB"])
def test_parse_refuses_what_is_not_a_positive_size(value) -> None:
    with pytest.raises(ConfigError, match="max_gpu_memory"):
        parse_max_gpu_memory(value)


def test_floor_is_the_largest_layer_with_its_gradients_beside_the_next() -> None:
    # layer 1 (300 MiB, 100 MiB trainable) running, layer 1's size again prefetched
    need = min_gpu_memory_bytes([100 * MIB, 300 * MIB, 50 * MIB], [0, 100 * MIB, 50 * MIB])
    assert need == 400 * MIB + 300 * MIB + WORKSPACE_BYTES
    check_gpu_memory_cap(need, [100 * MIB, 300 * MIB, 50 * MIB], [0, 100 * MIB, 50 * MIB])
    with pytest.raises(ConfigError, match=r"max_gpu_memory=1\.0 or more") as info:
        check_gpu_memory_cap(need - 1, [100 * MIB, 300 * MIB, 50 * MIB], [0, 100 * MIB, 50 * MIB])
    assert info.value.field == "max_gpu_memory"
    assert "layer 1" in str(info.value)


def test_capped_plan_groups_fewer_layers(cpu1: int) -> None:
    model = sized_model()
    # Uncapped (a limit of 100 GB): by size, groups of up to 3 decoder layers (1.1 x 0.3 GB).
    free = ModelExecutePlan.auto("fused", model, min_stages=1, model_memory_limit=100.0)
    assert max(len(r) for r in free.bwd_plan) == 3
    # Capped: a group holds at most 0.6 x cap / 2 GB of parameters.
    set_gpu_memory_cap(int(0.75 * GIB))  # 0.805 GB: 0.242 GB a group, two decoder layers
    assert get_min_gpu_memory() == pytest.approx(0.75 * GIB / 1e9)
    two = ModelExecutePlan.auto("fused", model, min_stages=1, by_size=True)
    assert [len(r) for r in two.bwd_plan] == [2] * 14 + [1]  # the embedding alone at the end
    assert two.fwd_plan[-1] == range(29, 30)
    set_gpu_memory_cap(GIB // 2)  # 0.537 GB: 0.161 GB a group, one decoder layer
    one = ModelExecutePlan.auto("fused", model, min_stages=1, by_size=True)
    assert [len(r) for r in one.bwd_plan] == [1] * 29
    for plan in (two, one):
        plan.check_valid(30, "fused")
    set_gpu_memory_cap(None)
    assert gpu_memory_cap_bytes() is None


def test_capped_room_widens_the_tail_less(cpu1: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each decoder layer keeps 0.5 GiB of activations, six held at once; the head's 0.5 GiB.
    meter = ActivationMeter(30)
    for j in range(1, 29):
        meter.record_layer(j, GIB // 2)
    meter.record_held(3 * GIB)
    meter.record_tail(29, GIB // 2)
    monkeypatch.setattr(one_device.torch.cuda, "max_memory_reserved", lambda d: int(3.5 * GIB))
    # An 80 GiB card: 72 - 3.5 GiB free, all six layers of the top group join the tail.
    wide = widen_tail(PLAN, meter, LAYER_GB, DeviceRoom(80 * GIB, int(3.5 * GIB)), 100.0)
    assert wide.fwd_plan[-1] == range(23, 30)
    # Capped at 4 GiB: 3.6 - 3.5 = 0.1 GiB free; a tail of 0.5 + 0.5 k GiB over the 3 held
    # fits while k <= 5.2: five layers.
    set_gpu_memory_cap(4 * GIB)
    room = DeviceRoom.of(torch.device("cpu"))
    assert room.total == 4 * GIB == device_memory_bytes(torch.device("cpu"))
    narrow = widen_tail(PLAN, meter, LAYER_GB, room, 100.0)
    assert narrow.fwd_plan[-1] == range(24, 30)
    assert narrow.bwd_plan[0] == range(23, 24)


def test_roundpipe_applies_its_cap_and_refuses_one_too_small(cpu1: int) -> None:
    layers = nn.Sequential(*[nn.Linear(64, 64) for _ in range(3)])
    rp = RoundPipe(layers, max_gpu_memory=0.5)
    assert rp.max_gpu_memory_bytes == GIB // 2 == gpu_memory_cap_bytes()
    assert get_min_gpu_memory() <= GIB / 2 / 1e9
    with pytest.raises(ConfigError, match=r"max_gpu_memory=0\.3 or more"):
        RoundPipe(nn.Sequential(nn.Linear(64, 64)), max_gpu_memory="16MiB")


def test_env_var_is_the_default(cpu1: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RP_GPU_MEMORY_GIB", "0.75")
    rp = RoundPipe(nn.Sequential(nn.Linear(8, 8)))
    assert rp.max_gpu_memory_bytes == int(0.75 * GIB) == gpu_memory_cap_bytes()
    explicit = RoundPipe(nn.Sequential(nn.Linear(8, 8)), max_gpu_memory="1GiB")
    assert explicit.max_gpu_memory_bytes == GIB == gpu_memory_cap_bytes()
    monkeypatch.setenv("RP_GPU_MEMORY_GIB", "a lot")
    with pytest.raises(ConfigError, match="RP_GPU_MEMORY_GIB"):
        RoundPipe(nn.Sequential(nn.Linear(8, 8)))
