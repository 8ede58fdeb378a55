"""Data parallel over gloo: two spawned ranks (cpu:1 each) against one process.

Same global batch: losses, gradients and weights after 3 Adam steps equal the
single-process run within fp32 rounding (sync and async steps, sharded and replicated
optimizer state, engine.optim.Adam and torch.optim.AdamW); a checkpoint saved by 2 ranks
resumes on 1 and back; bad input fails clearly (an odd batch, mismatched models, a rank
that dies).
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from engine.device import reset_devices

from . import dp_worker

WORLD = 2
TOL = {"rtol": 1e-5, "atol": 1e-6}
_PRELOAD = ["torch", "torch.distributed", "engine", "engine.optim", "tests.integration.dp_worker"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(
    scenario: str, out: Path, timeout_s: float = 90.0, world: int = WORLD
) -> list[dict[str, Any]]:
    """Run `scenario` on `world` spawned ranks; return what each rank that finished wrote.

    CPU ranks fork from a forkserver that imported torch and the engine once (a fresh
    interpreter's imports are most of a small scenario's time); NCCL ranks start fresh.
    """
    if scenario == "nccl":
        ctx = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)  # read when the forkserver starts: the first call
    port = _free_port()
    procs = [
        ctx.Process(target=dp_worker.rank_main, args=(r, world, port, str(out), scenario))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    errors = [f.read_text() for f in sorted(out.glob(f"{scenario}-rank*.err"))]
    assert not alive, f"{scenario}: rank(s) still running after {timeout_s} s; {errors}"
    assert not errors, "\n".join(errors)
    results = []
    for r in range(world):
        f = out / f"{scenario}-rank{r}.pt"
        results.append(torch.load(f, weights_only=False) if f.exists() else None)
    return results


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The 'equal' scenario once for every test of this module, then the oracles."""
    out = tmp_path_factory.mktemp("dp")
    ranks = _spawn("equal", out)
    reset_devices()
    return {"out": out, "ranks": ranks}


def _oracle(**kwargs: Any) -> dict[str, Any]:
    return dp_worker.train(process_group=None, world=WORLD, **kwargs)


@pytest.mark.parametrize("shard", [True, False])
def test_staleness_zero_equals_the_sync_step_on_two_ranks(
    spawned: dict[str, Any], shard: bool
) -> None:
    """step_staleness=0 under data parallel: each layer's all-gather after step_fn releases
    it; every rank's losses, gradients and weights are its synchronous run's, bit for bit."""
    for got in spawned["ranks"]:
        fresh, sync = got[f"fresh,shard={shard}"], got[f"sync=True,shard={shard}"]
        assert fresh["losses"] == sync["losses"]
        for key in ("grads", "weights"):
            assert fresh[key].keys() == sync[key].keys()
            for name, value in fresh[key].items():
                assert torch.equal(value, sync[key][name]), (key, name)
        # each layer went out as the optimizer finished it, not after step_fn
        assert fresh["early_layers"] > 0 and sync["early_layers"] == 0
    stale = spawned["ranks"][0][f"sync=False,shard={shard}"]
    assert stale["losses"][1:] != spawned["ranks"][0][f"sync=True,shard={shard}"]["losses"][1:]


@pytest.mark.parametrize("sync", [True, False])
@pytest.mark.parametrize("shard", [True, False])
def test_two_ranks_equal_one_process(spawned: dict[str, Any], sync: bool, shard: bool) -> None:
    expected = _oracle(sync=sync, shard=shard)
    for rank, got in enumerate(spawned["ranks"]):
        run = got[f"sync={sync},shard={shard}"]
        torch.testing.assert_close(run["losses"], expected["losses"], **TOL)
        torch.testing.assert_close(run["norms"], expected["norms"], **TOL)
        assert len(run["norms"]) == dp_worker.STEPS
        assert run["pending_after_call"] == 0, "the call's gradients were left to the step"
        kept, grads, can_keep = run["kept_after_call"]
        assert can_keep and grads > 0 and kept == grads, run["kept_after_call"]
        for name, w in expected["weights"].items():
            torch.testing.assert_close(run["weights"][name], w, **TOL, msg=f"rank {rank} {name}")
            torch.testing.assert_close(run["grads"][name], expected["grads"][name], **TOL)


@pytest.mark.parametrize("staleness", [0, 1])
def test_accumulated_calls_equal_one_process(spawned: dict[str, Any], staleness: int) -> None:
    """Two calls before each step: every call's gradients are reduced during its own backward
    and summed in fp32, as one process sums its two downloads."""
    expected = dp_worker.accumulate(process_group=None, world=WORLD, staleness=staleness)
    for rank, got in enumerate(spawned["ranks"]):
        run = got[f"accumulate,staleness={staleness}"]
        torch.testing.assert_close(run["losses"], expected["losses"], **TOL)
        for name, w in expected["weights"].items():
            torch.testing.assert_close(run["weights"][name], w, **TOL, msg=f"rank {rank} {name}")


def test_sharded_state_is_split_and_any_torch_optimizer_works(spawned: dict[str, Any]) -> None:
    expected = _oracle(sync=False, shard=True, optimizer="torch")
    shards = [r["torch-adamw"]["shard_numel"] for r in spawned["ranks"]]
    assert sum(shards) == expected["shard_numel"]  # every element in exactly one shard
    assert max(shards) < expected["shard_numel"]  # ... and neither rank holds them all
    for got in spawned["ranks"]:
        torch.testing.assert_close(got["torch-adamw"]["losses"], expected["losses"], **TOL)
        for name, w in expected["weights"].items():
            torch.testing.assert_close(got["torch-adamw"]["weights"][name], w, **TOL)
    replicated = [r["sync=True,shard=False"]["shard_numel"] for r in spawned["ranks"]]
    assert replicated == [expected["shard_numel"]] * WORLD


def test_checkpoint_two_ranks_to_one_and_back(spawned: dict[str, Any]) -> None:
    out: Path = spawned["out"]
    steps = dp_worker.STEPS
    # The oracle: one process, sync steps straight through.
    rp, opt = dp_worker.build(shard=True, microbatches=4, optimizer="engine", process_group=None)
    expected = dp_worker.run_steps(rp, opt, 0, steps + 3, sync=True)
    rp.synchronize()
    final = {n: p.detach().clone() for n, p in rp.named_parameters()}
    for got in spawned["ranks"]:
        torch.testing.assert_close(got["ckpt_losses"], expected[:steps], **TOL)
    one = dp_worker.resume(
        str(out / "ckpt-2ranks.pt"),
        first=steps,
        last=steps + 2,
        save_to=str(out / "ckpt-1rank.pt"),
        process_group=None,
    )
    assert one["extra"] == {"step": steps}
    torch.testing.assert_close(one["losses"], expected[steps : steps + 2], **TOL)
    back = _spawn("back", out)
    reset_devices()
    for got in back:
        assert got["resume"]["extra"] == {"step": steps + 2}
        torch.testing.assert_close(got["resume"]["losses"], expected[steps + 2 :], **TOL)
        for name, w in final.items():
            torch.testing.assert_close(got["resume"]["weights"][name], w, **TOL)
        # The bad-input cases of the same run.
        assert "ConfigError" in got["odd_batch"] and "11 rows" in got["odd_batch"]
        assert "multiple of the world size 2" in got["odd_batch"]
        assert got["after_odd"] > 0
        assert "ConfigError" in got["auto_split"] and "one RoundPipe" in got["auto_split"]
        assert "ConfigError" in got["mismatch"] and "differs from rank 0" in got["mismatch"]
        assert "(19, 5)" in got["mismatch"] or "19" in got["mismatch"]


def test_a_dead_rank_fails_the_others_within_the_timeout(tmp_path: Path) -> None:
    got = _spawn("dead", tmp_path)
    survivor = got[0]
    assert survivor is not None and got[1] is None  # rank 1 died before writing
    assert survivor["error"] != "no error"
    assert "DistributedError" in survivor["error"] or "StepError" in survivor["error"]
    assert "rank 0 of 2" in survivor["error"] and "died" in survivor["error"]
    assert survivor["elapsed_s"] < 30.0


@pytest.fixture(scope="module")
def modes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The 'modes' scenario once: global and shard batches, a mismatch, close()."""
    ranks = _spawn("modes", tmp_path_factory.mktemp("dp-modes"))
    reset_devices()
    return ranks


def test_own_shards_train_as_the_global_batch(modes: list[dict[str, Any]]) -> None:
    """batch_is_global=False with rank r given rows r*6..r*6+6: the run of the global batch."""
    for rank, got in enumerate(modes):
        assert len(got["shard"]["losses"]) == dp_worker.STEPS
        # The same rows through the same kernels on each rank: equal, not merely close.
        assert got["shard"]["losses"] == got["global"]["losses"]
        for name, w in got["global"]["weights"].items():
            assert torch.equal(got["shard"]["weights"][name], w), f"rank {rank} {name}"
    expected = _oracle(sync=False, shard=True)  # one process, the global batch
    torch.testing.assert_close(modes[0]["global"]["losses"], expected["losses"][:-1], **TOL)


def test_different_batches_fail_on_every_rank_naming_the_option(
    modes: list[dict[str, Any]],
) -> None:
    for got in modes:
        for key, what in (("mismatch", "values"), ("mismatch_shape", "shapes")):
            assert got[key].startswith("ConfigError"), got[key]
            assert "different batches" in got[key] and what in got[key]
            assert "batch_is_global=False" in got[key]
        assert got["mismatch_s"] < 5.0  # raised at once, no rank left in a collective
        assert got["after_mismatch"] > 0  # the ranks stay in step: the next call works


def test_close_joins_the_engine_group_threads(modes: list[dict[str, Any]]) -> None:
    for got in modes:
        # Three groups (the default one, the engine's control and bulk), two threads each.
        assert got["gloo_threads_open"] == 6
        assert got["gloo_threads_closed"] == 2
        assert "ConfigError" in got["after_close"] and "closed RoundPipe" in got["after_close"]
