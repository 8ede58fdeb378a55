"""Checkpoints: atomic commit, rotation, partial-write cleanup, optimizer and RNG round trips."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from rp_service import durable
from rp_service.worker import checkpoint as ckpt


def _write(root, step, keep=2, value=1.0):
    return ckpt.write_checkpoint(
        root,
        step,
        tensors={"model.safetensors": {"w": torch.full((3, 5), value)}},
        state={"step": step},
        files={"config.json": b"{}"},
        keep=keep,
    )


def test_commit_and_read_back(tmp_path):
    path, size_bytes = _write(tmp_path, 7, value=2.5)
    assert path.name == "step-00000007"
    assert size_bytes == sum(p.stat().st_size for p in path.iterdir())
    tensors, state = ckpt.read_checkpoint(path)
    assert state == {"step": 7}
    assert torch.equal(tensors["model.safetensors"]["w"], torch.full((3, 5), 2.5))
    assert (path / "config.json").read_bytes() == b"{}"
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000007"]  # no temp dir left


def test_keeps_the_newest_k(tmp_path):
    for step in (10, 20, 30, 40):
        _write(tmp_path, step, keep=2)
    assert [c.step for c in ckpt.list_checkpoints(tmp_path)] == [30, 40]
    assert ckpt.latest_checkpoint(tmp_path).step == 40
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000030", "step-00000040"]


def test_partial_writes_are_invisible_and_removed(tmp_path, monkeypatch):
    _write(tmp_path, 5)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    # A crash before the rename: the step-10 checkpoint must not appear.
    monkeypatch.setattr(durable, "fsync_path", crash)
    with pytest.raises(OSError):
        _write(tmp_path, 10)
    monkeypatch.undo()
    assert ckpt.latest_checkpoint(tmp_path).step == 5
    # An error in the writer gives the space back at once (a full disk stays usable) ...
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
    # ... a killed writer leaves its temporary directory for remove_partial.
    (tmp_path / ".tmp-step-00000010-12345").mkdir()
    (tmp_path / ".tmp-step-00000010-12345" / "model.safetensors").write_bytes(b"partial")
    # A directory with a checkpoint name but no state.json (not ours) is not committed either.
    (tmp_path / "step-00000099").mkdir()
    assert ckpt.latest_checkpoint(tmp_path).step == 5
    assert ckpt.remove_partial(tmp_path) == 1
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


def test_rewriting_a_step_replaces_it(tmp_path):
    _write(tmp_path, 3, value=1.0)
    path, _ = _write(tmp_path, 3, value=4.0)
    tensors, _ = ckpt.read_checkpoint(path)
    assert tensors["model.safetensors"]["w"][0, 0] == 4.0
    assert [c.step for c in ckpt.list_checkpoints(tmp_path)] == [3]


def test_optimizer_state_round_trip(tmp_path):
    params = [torch.nn.Parameter(torch.randn(17)), torch.nn.Parameter(torch.randn(3, 4))]
    opt = torch.optim.AdamW(params, lr=0.01, betas=(0.8, 0.9))
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    tensors, meta = ckpt.flatten_optimizer_state(opt.state_dict())
    path, _ = ckpt.write_checkpoint(
        tmp_path, 3, tensors={"optimizer.safetensors": tensors}, state={"opt": meta}, keep=1
    )
    loaded, state = ckpt.read_checkpoint(path)

    clone = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = torch.optim.AdamW(clone, lr=1.0)
    opt2.load_state_dict(
        ckpt.unflatten_optimizer_state(loaded["optimizer.safetensors"], state["opt"])
    )
    assert opt2.param_groups[0]["betas"] == (0.8, 0.9)
    for p, q in zip(params, clone, strict=True):
        g = torch.randn_like(p)
        p.grad, q.grad = g, g.clone()
    opt.step()
    opt2.step()
    for p, q in zip(params, clone, strict=True):
        assert torch.equal(p, q)


def test_rng_round_trip():
    tensors, meta = ckpt.capture_rng()
    expected = (torch.rand(3), np.random.rand(2), random.random())
    torch.rand(5), np.random.rand(5), random.random()
    ckpt.restore_rng(tensors, meta)
    got = (torch.rand(3), np.random.rand(2), random.random())
    assert torch.equal(got[0], expected[0])
    assert np.array_equal(got[1], expected[1])
    assert got[2] == expected[2]


def test_removing_a_checkpoint_never_shows_a_half_deleted_step(tmp_path, monkeypatch):
    """The daemon's pruning and the worker's rotation rename a committed folder away before
    deleting its files: the chaos soak once listed a step-9 whose state.json was already
    gone while the daemon's rmtree ran."""
    import shutil

    from rp_service.checkpoint_dirs import TMP_PREFIX, remove_checkpoint_dir

    step = tmp_path / "step-9"
    step.mkdir()
    (step / "state.json").write_text("{}")
    (step / "weights.bin").write_bytes(b"x")
    stale = tmp_path / f"{TMP_PREFIX}del-step-9"  # a removal a crash interrupted
    stale.mkdir()
    (stale / "weights.bin").write_bytes(b"y")
    seen: list[tuple[str, bool]] = []
    real_rmtree = shutil.rmtree

    def watching_rmtree(path, *args, **kwargs):
        seen.append((Path(path).name, step.exists()))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", watching_rmtree)
    remove_checkpoint_dir(step)
    assert seen == [(stale.name, True), (stale.name, False)]  # step-9 gone before any file
    assert list(tmp_path.iterdir()) == []
    remove_checkpoint_dir(step)  # already gone: nothing to do
    assert ckpt.latest_checkpoint(tmp_path) is None
