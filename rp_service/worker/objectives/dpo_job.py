"""A DPO job's side of the training loop: its pairs, its reference, its step, its evaluation.

`training._Run` asks this object, when ``train.objective`` is ``dpo``, for the data (pairs
instead of token blocks: ``train.batch_size`` counts pairs), for each step's
`forward_backward` and metrics, and for the validation loss; everything else (optimizer,
schedule, checkpoints, pause and resume, output) is the loop's as for SFT.

The reference: LoRA jobs run the base with the adapters off, a forward without gradients
in every step (and in every evaluation); full fine-tuning jobs take the reference
log-probabilities of every train and validation pair once, before the first step, and
keep them in the job directory (`reference`), so a resumed attempt loads them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...data.formats import DataFormatError, iter_records
from ...data.preference import PreferencePairs, build_pairs, synthetic_pairs
from ...demo import SYNTHETIC, SYNTHETIC_TRAIN_RECORDS, SYNTHETIC_VALID_RECORDS
from ...errors import JobFailure
from . import dpo
from .reference import REFERENCE_FILE, data_digest, read_reference, write_reference

if TYPE_CHECKING:
    from ...data.tokenizer import JobTokenizer
    from ...schemas import JobSpec
    from ..training import JobPaths

__all__ = ["DpoObjective"]

log = logging.getLogger(__name__)

_MAX_EVAL_PAIRS = 256  # validation pairs per evaluation (the first ones, in order)


def _load_pairs(
    source: str, param: str, spec: JobSpec, tokenizer: JobTokenizer, *, valid: bool
) -> PreferencePairs:
    try:
        if source == SYNTHETIC:
            count = SYNTHETIC_VALID_RECORDS if valid else SYNTHETIC_TRAIN_RECORDS
            records = list(enumerate(synthetic_pairs(count, seed=0, valid=valid), start=1))
        else:
            if not Path(source).is_file():
                raise JobFailure("invalid_data", f"{param}: file {source!r} not found", param=param)
            fmt = spec.data.format
            records = []
            for line, line_format, record in iter_records(source, fmt):
                if line_format != "preference":
                    raise DataFormatError(
                        f"train.objective dpo needs preference pairs, this file holds "
                        f"{line_format} records",
                        line=line,
                    )
                records.append((line, record))
        return build_pairs(records, tokenizer, seq_len=spec.data.seq_len)
    except DataFormatError as exc:
        raise exc.in_field(param) from exc


class DpoObjective:
    """Pairs, reference and loss of one attempt of a DPO job (an `Objective`)."""

    data_format = "preference"
    needs_sync_before_step = False
    steps_per_batch = 1

    def __init__(
        self, spec: JobSpec, paths: JobPaths, tokenizer: JobTokenizer, *, valid_source: str | None
    ) -> None:
        assert spec.dpo is not None  # JobSpec fills the defaults for objective dpo
        self.beta = spec.dpo.beta
        self.label_smoothing = spec.dpo.label_smoothing
        self.train = _load_pairs(paths.train_path, "data.train", spec, tokenizer, valid=False)
        self.valid = (
            _load_pairs(valid_source, "data.valid", spec, tokenizer, valid=True)
            if valid_source
            else None
        )
        self.reference_path = paths.checkpoint_dir.parent / REFERENCE_FILE
        self.lora = False
        # Full fine-tuning: (pairs, 2) reference log-probabilities per dataset.
        self.ref_train: torch.Tensor | None = None
        self.ref_valid: torch.Tensor | None = None
        self.batch_size = spec.train.batch_size
        self._values: list[torch.Tensor] | None = None

    # -- the reference

    def prepare(self, rp: Any, hf_model: Any, *, lora: bool, resuming: bool) -> None:
        """Before the first step of this attempt: a LoRA job needs nothing; a full one loads
        its stored reference, or (first attempt only) computes and stores it."""
        self.lora = lora
        if lora:
            return
        parts = [self.train.input_ids, self.train.targets]
        if self.valid is not None:
            parts += [self.valid.input_ids, self.valid.targets]
        digest = data_digest(*parts)
        stored = read_reference(self.reference_path)
        if stored is not None and stored[1] == digest:
            tensors = stored[0]
            self.ref_train = tensors["train"]
            self.ref_valid = tensors.get("valid")
            log.info("DPO reference: loaded %s", self.reference_path)
            return
        if resuming:
            # The weights have moved since the reference was taken: it cannot be redone.
            why = "is missing" if stored is None else "belongs to other data"
            raise JobFailure(
                "reference_mismatch",
                f"the stored DPO reference {self.reference_path} {why}; the training data "
                "changed since the job started, or the file was removed. Start a new job",
                param="data.train",
            )
        self.ref_train = self._full_pass(rp, self.train)
        tensors = {"train": self.ref_train}
        if self.valid is not None:
            self.ref_valid = self._full_pass(rp, self.valid, limit=_MAX_EVAL_PAIRS)
            tensors["valid"] = self.ref_valid
        write_reference(self.reference_path, tensors, digest=digest)
        log.info(
            "DPO reference: %d pairs scored, stored in %s", len(self.train), self.reference_path
        )

    def _full_pass(
        self, rp: Any, pairs: PreferencePairs, *, limit: int | None = None
    ) -> torch.Tensor:
        """(pairs, 2) log-probabilities of `pairs` under the model as it stands."""
        count = len(pairs) if limit is None else min(limit, len(pairs))
        out = torch.empty(count, 2, dtype=torch.float32)
        for start in range(0, count, self.batch_size):
            idx = torch.arange(start, min(start + self.batch_size, count))
            ids, targets, _ = pairs.batch(idx)
            out[idx] = self._logps(rp, ids, targets).view(-1, 2)
        return out

    def _logps(self, rp: Any, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return dpo.sequence_logps(rp, ids, targets, num_microbatch=rp.num_microbatch)

    def _reference(
        self, rp: Any, ids: torch.Tensor, targets: torch.Tensor, stored: torch.Tensor | None
    ) -> torch.Tensor:
        if self.lora:
            from engine.adapters.lora import adapters_disabled

            with adapters_disabled(rp):
                return self._logps(rp, ids, targets)
        assert stored is not None
        return stored.reshape(-1)

    # -- a step

    def forward_backward(
        self, rp: Any, step: int, indices: torch.Tensor
    ) -> tuple[torch.Tensor, int]:
        """Forward and backward of the pairs at `indices`; the loss and the policy tokens."""
        from engine import RoundPipeRunConfig

        ids, targets, tokens = self.train.batch(indices)
        ref = self._reference(
            rp, ids, targets, None if self.ref_train is None else self.ref_train[indices]
        )
        counts = dpo.pair_counts(len(indices), rp.num_microbatch)
        self._values = rp.forward_backward(
            input_kwargs={"input_ids": ids, "return_logits": False},
            label=(targets, ref),
            loss_fn=dpo.dpo_loss_fn(
                beta=self.beta, label_smoothing=self.label_smoothing, num_pairs=len(indices)
            ),
            run_config=RoundPipeRunConfig(
                num_microbatch=len(counts),
                split_input=dpo.split_rows(counts),
                split_label=dpo.split_label(counts),
            ),
        )
        return self._values[0], tokens

    def metrics(self) -> dict[str, float]:
        """TRL-named metrics of the last step (reads its values: a host sync)."""
        assert self._values is not None
        _, named = dpo.metrics_of(self._values)
        return {k: round(v, 6) for k, v in named.items()}

    def evaluate(self, rp: Any) -> dict[str, float]:
        """Mean DPO loss over the validation pairs with the current (synced) weights."""
        assert self.valid is not None
        count = min(len(self.valid), _MAX_EVAL_PAIRS)
        policy, ref = [], []
        for start in range(0, count, self.batch_size):
            idx = torch.arange(start, min(start + self.batch_size, count))
            ids, targets, _ = self.valid.batch(idx)
            policy.append(self._logps(rp, ids, targets))
            stored = None if self.ref_valid is None else self.ref_valid[idx]
            ref.append(self._reference(rp, ids, targets, stored))
        loss, _ = dpo.mean_loss(
            torch.cat(policy),
            torch.cat(ref),
            beta=self.beta,
            label_smoothing=self.label_smoothing,
        )
        return {"valid_loss": loss}

    def state_dict(self) -> dict[str, Any]:
        return {}  # the full-tuning reference is its own file (`reference`)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass
