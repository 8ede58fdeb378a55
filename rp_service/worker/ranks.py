"""A worker's place among the data-parallel ranks of a multi-node job (rp_service.cluster).

One process, as on one box, is rank 0 of 1 and every method here is trivial (no
collective, no extra file). Under a process group of N ranks (the engine's data parallel,
ZeRO-1: each rank steps its own rows of every parameter):

- the ranks agree on a pause (one small all-reduce where the single process reads its
  flag), so they all stop after the same step;
- a checkpoint is rank 0's usual checkpoint (the model copy every rank holds, rank 0's
  shard as its masters and optimizer state, the RNG) plus one shard file and its JSON per
  other rank, written by that rank into a temporary sibling; rank 0 moves them in and
  commits the folder only after a barrier that every shard has passed, so a committed
  checkpoint always has all N shards;
- a resume reads the model copy and the step from that folder, and its own rank's shard:
  any N nodes (the same N) continue exactly.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..durable import TMP_PREFIX
from ..errors import JobFailure
from . import checkpoint as ckpt

__all__ = ["Ranks", "shard_names"]

log = logging.getLogger(__name__)


def shard_names(rank: int) -> tuple[str, str]:
    """The file names of rank `rank`'s shard: tensors, then JSON (optimizer groups)."""
    return f"rank-{rank:05d}.shard", f"rank-{rank:05d}.json"


@dataclass(frozen=True, slots=True)
class Ranks:
    """This process's rank, the world size, and the gloo group of the agreements."""

    rank: int = 0
    world: int = 1
    group: Any = None

    @classmethod
    def current(cls) -> Ranks:
        """From torch.distributed's default group, when initialised with > 1 rank
        (collective then: every rank calls it at the same point)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return cls()
        # CPU flags on a group of their own: the default group may be NCCL's
        group = dist.new_group(backend="gloo")
        return cls(rank=dist.get_rank(), world=dist.get_world_size(), group=group)

    def any(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank (collective)."""
        if self.world == 1:
            return flag
        import torch.distributed as dist

        t = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    # -- checkpoints

    def staging_dir(self, checkpoint_dir: Path, step: int) -> Path:
        """Where ranks >= 1 write their shards of `step` (removed with partial writes)."""
        return checkpoint_dir / f"{TMP_PREFIX}shards-{step:08d}"

    def write_shard(
        self,
        checkpoint_dir: Path,
        step: int,
        masters: list[torch.Tensor],
        optimizer: torch.optim.Optimizer,
    ) -> list[Path]:
        """Ranks >= 1: write this rank's shard, then wait for every rank's (collective);
        rank 0 gets the other ranks' files to move into its checkpoint."""
        staging = self.staging_dir(checkpoint_dir, step)
        if self.rank > 0:
            staging.mkdir(parents=True, exist_ok=True)
            opt_tensors, opt_meta = ckpt.flatten_optimizer_state(optimizer.state_dict())
            tensors = {f"master.{i}": p.detach().clone() for i, p in enumerate(masters)}
            tensors.update({f"optim.{k}": v for k, v in opt_tensors.items()})
            tensor_name, meta_name = shard_names(self.rank)
            save_file(tensors, str(staging / tensor_name))
            (staging / meta_name).write_text(json.dumps(opt_meta))
        self.barrier()  # every shard is on disk: rank 0 may commit
        if self.rank > 0:
            return []
        return [staging / name for r in range(1, self.world) for name in shard_names(r)]

    def read(self, info: ckpt.CheckpointInfo) -> ckpt.TrainingState:
        """`read_training_checkpoint`, with this rank's masters and optimizer state."""
        state = ckpt.read_training_checkpoint(info)
        written = json.loads((info.path / ckpt.STATE_FILE).read_text()).get("world_size", 1)
        if written != self.world:
            raise JobFailure(
                "checkpoint_mismatch",
                f"checkpoint {info.path} was written by {written} rank(s), this run has "
                f"{self.world}; resume with engine.nodes={written}",
                param="engine.nodes",
            )
        if self.rank == 0:
            return state
        tensor_name, meta_name = shard_names(self.rank)
        tensors = load_file(str(info.path / tensor_name))
        meta = json.loads((info.path / meta_name).read_text())
        count = sum(1 for k in tensors if k.startswith("master."))
        masters = [tensors[f"master.{i}"] for i in range(count)]
        opt = {k.removeprefix("optim."): v for k, v in tensors.items() if k.startswith("optim.")}
        return replace(state, masters=masters, optimizer=ckpt.unflatten_optimizer_state(opt, meta))
