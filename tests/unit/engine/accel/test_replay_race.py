"""Replay slots under concurrent drops: a device's acquire racing another device's drop.

On several GPUs a job that sees a micro-batch over the replay limit stops replay for the
model and drops every device's slots (RoundPipe.stop_replay) while the other devices'
workers are acquiring slots for their own jobs; 2 of 7 four-GPU runs died of it
(`IndexError` in `Replayer.acquire`). The mechanism is the same on the virtual CPU
devices, so it is tested here: one interleaving forced exactly, then many runs on 4 and 6
devices where the drop comes from whichever job sees the limit first.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from engine import RoundPipe, RoundPipeRunConfig
from engine.accel import graphs
from engine.device import get_devices
from tests.unit.engine.accel.test_replay import batch, make_model, mse
from tests.unit.engine.conftest import use_devices


def _replicas(rp: RoundPipe, layer_ids: range) -> list[Any]:
    dev = get_devices()[0]
    return [rp._replica(dev, j) for j in layer_ids]


def test_a_drop_between_two_layers_of_one_acquire_waits_for_it(
    replay_on_cpu: None, cpu4: int
) -> None:
    """The exact interleaving of the crash: another thread drops the slots while an
    acquire has made the first of two same-shaped layers' slots. The drop waits for the
    acquire; the acquire hands out one slot per layer, all from one set."""
    rp = RoundPipe(make_model(blocks=3), model_run_config=RoundPipeRunConfig(num_microbatch=2))
    rep = graphs.replayer(get_devices()[0])
    assert rep is not None
    replicas = _replicas(rp, range(1, 4))  # three blocks: one signature
    real_new_slot = rep._new_slot
    dropper: list[threading.Thread] = []

    def new_slot_then_drop(replica: Any) -> graphs.Slot:
        slot = real_new_slot(replica)
        if not dropper:
            dropper.append(threading.Thread(target=rep.drop_slots))
            dropper[0].start()
            dropper[0].join(timeout=0.5)  # without the lock the drop finishes here
        return slot

    rep._new_slot = new_slot_then_drop  # type: ignore[method-assign]
    try:
        slots = rep.acquire(replicas, [True, True, True])
    finally:
        rep._new_slot = real_new_slot  # type: ignore[method-assign]
        dropper[0].join(timeout=10)
    assert not dropper[0].is_alive()
    assert len({s.number for s in slots if s is not None}) == 3
    assert rep._sets == {}  # the drop ran once the acquire was done


@pytest.mark.parametrize("devices", [4, 6])
def test_replay_stopped_mid_call_on_many_devices(replay_on_cpu: None, devices: int) -> None:
    """Many calls whose micro-batches cross the replay limit while other devices acquire
    slots: every call finishes, and training equals the same steps without replay."""
    gen = use_devices(f"cpu:{devices}", devices)
    next(gen)
    try:
        x, y = batch(rows=24, seq=6)
        for trial in range(8):
            # The small first call replays (slots on every device); the second call's
            # micro-batches cross the limit on whichever device starts first.
            graphs.REPLAY_MAX_TOKENS = 6 * 3 + trial % 3
            results = []
            for replay in (True, False):
                graphs.ENABLED = replay
                rp = RoundPipe(
                    make_model(blocks=6),
                    optim_dtype=torch.float32,
                    model_run_config=RoundPipeRunConfig(num_microbatch=8),
                )
                opt = torch.optim.SGD(rp.optim_parameters(), lr=1e-2)

                def step_fn(opt: torch.optim.Optimizer = opt) -> None:
                    opt.step()
                    opt.zero_grad()

                losses = [rp.forward_backward((x[:16],), label=y[:16], loss_fn=mse)]
                rp.step(step_fn)
                losses.append(rp.forward_backward((x,), label=y, loss_fn=mse))
                rp.step(step_fn)
                rp.synchronize()
                weights = [p.detach().clone() for p in rp.model.parameters()]
                results.append((losses, weights))
                graphs.drop_all_slots()
            for a, b in zip(results[0][0], results[1][0], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
            for a, b in zip(results[0][1], results[1][1], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
    finally:
        for _ in gen:
            pass
