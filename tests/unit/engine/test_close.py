"""RoundPipe.close(): waits for the queued steps, stops the engine's threads once no open
model is left, is idempotent and a context manager; open models are held weakly. And the
pieces of data parallel's batch modes that need no processes: the run-config option and
the batch digest the ranks compare."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator

import pytest
import torch

from engine import RoundPipe, RoundPipeRunConfig
from engine import threads as rp_threads
from engine.errors import ConfigError
from engine.parallel.data_parallel import _batch_digest
from engine.run_config import FullRoundPipeRunConfig

from ._models import make_batch, make_model


@pytest.fixture(autouse=True)
def own_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Only this test's models count as open (other tests' models may still be alive)."""
    monkeypatch.setattr(rp_threads, "_open", weakref.WeakSet())
    yield


def _engine_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("rp-") and t.is_alive()}


def _model() -> RoundPipe:
    return RoundPipe(
        make_model(p_drop=0.0),
        process_group=None,
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )


def _train_once(rp: RoundPipe, step_fn: object) -> None:
    x, y = make_batch(5, seed=1)
    rp.forward_backward((x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).mean())
    rp.step(step_fn, is_async=True)


def test_close_waits_for_the_queued_step_then_stops_the_threads(cpu3: int) -> None:
    rp = _model()
    done: list[float] = []

    def slow_step() -> None:
        time.sleep(0.2)
        done.append(time.monotonic())

    _train_once(rp, slow_step)
    assert {"rp-optimizer", "rp-device-0", "rp-device-2"} <= _engine_threads()
    rp.close()
    assert len(done) == 1  # the step ran to its end before close returned
    assert _engine_threads() == set()
    rp.close()  # a second close does nothing
    assert _engine_threads() == set()


def test_shared_threads_stop_with_the_last_open_model(cpu3: int) -> None:
    a, b = _model(), _model()
    _train_once(a, lambda: None)
    _train_once(b, lambda: None)
    a.close()
    assert {"rp-optimizer", "rp-device-0"} <= _engine_threads()  # b still uses them
    with b:
        _train_once(b, lambda: None)
    assert _engine_threads() == set()


def test_close_raises_a_failed_step_after_stopping(cpu3: int) -> None:
    rp = _model()

    def broken() -> None:
        raise ValueError("boom")

    _train_once(rp, broken)
    with pytest.raises(Exception, match="boom"):
        rp.close()
    assert _engine_threads() == set()


def test_open_models_are_held_weakly_and_closed_at_exit(cpu3: int) -> None:
    dropped = _model()
    ref = weakref.ref(dropped)
    del dropped
    gc.collect()
    assert ref() is None  # the registry did not keep it alive
    kept = _model()
    _train_once(kept, lambda: None)
    assert rp_threads.any_open()
    rp_threads._close_open_at_exit()  # what atexit runs
    assert not rp_threads.any_open()
    assert not rp_threads.mark_closed(kept)  # closed already
    assert _engine_threads() == set()


# ---- the batch modes: option and digest --------------------------------------------
def test_batch_is_global_defaults_to_true_and_merges() -> None:
    model_level = RoundPipeRunConfig(num_microbatch=2)
    assert FullRoundPipeRunConfig(RoundPipeRunConfig(), model_level, num_devices=1).batch_is_global
    call = RoundPipeRunConfig(batch_is_global=False)
    assert not FullRoundPipeRunConfig(call, model_level, num_devices=1).batch_is_global
    shard_model = RoundPipeRunConfig(batch_is_global=False)
    per_call = RoundPipeRunConfig(batch_is_global=True)
    assert FullRoundPipeRunConfig(per_call, shard_model, num_devices=1).batch_is_global
    with pytest.raises(ConfigError, match="batch_is_global"):
        RoundPipeRunConfig(batch_is_global=1)  # type: ignore[arg-type]


def _tree(x: torch.Tensor, y: torch.Tensor, **kwargs: object) -> object:
    return ((x,), dict(kwargs), y)


def test_batch_digest_same_for_equal_batches_different_otherwise() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1001, 7, generator=gen)  # more elements than samples: strided
    y = torch.randint(0, 50_000, (1001,), generator=gen)
    base = _batch_digest(_tree(x, y, mask=None))
    assert torch.equal(base, _batch_digest(_tree(x.clone(), y.clone(), mask=None)))
    swapped = x.clone()
    swapped[[0, 1000]] = swapped[[1000, 0]]  # the same values, two rows exchanged
    changed = x.clone()
    changed[0, 0] += 1.0
    others = {
        "a changed value": _tree(changed, y, mask=None),
        "two rows exchanged": _tree(swapped, y, mask=None),
        "another label": _tree(x, y.flip(0), mask=None),
        "fewer rows": _tree(x[:1000], y[:1000], mask=None),
        "another dtype": _tree(x.double(), y, mask=None),
        "another option": _tree(x, y, mask=True),
    }
    for what, tree in others.items():
        assert not torch.equal(_batch_digest(tree), base), what
    # Structure in entry 0, values in the others (what the error message names).
    assert _batch_digest(others["a changed value"])[0] == base[0]
    assert _batch_digest(others["fewer rows"])[0] != base[0]


def test_batch_digest_is_finite_for_nan_and_inf() -> None:
    x = torch.tensor([[float("nan"), float("inf")], [-float("inf"), 1e308]])
    digest = _batch_digest(_tree(x, x))
    assert torch.isfinite(digest).all()
    assert torch.equal(digest, _batch_digest(_tree(x.clone(), x.clone())))
