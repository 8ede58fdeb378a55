"""One body hash for both APIs' retried creates (rp_service.jobs.idempotency)."""

from __future__ import annotations

import importlib

from rp_service.jobs.idempotency import body_sha256
from rp_service.openai.schemas import FineTuningJobCreate
from rp_service.schemas import JobSpec

_SPEC = {
    "model": {"preset": "qwen3"},
    "data": {"train": "synthetic", "seq_len": 64},
    "train": {"steps": 2, "batch_size": 4},
}


def test_the_hash_ignores_key_order_and_unset_defaults() -> None:
    first = JobSpec.model_validate(_SPEC)
    reordered = JobSpec.model_validate(dict(reversed(list(_SPEC.items()))))
    assert body_sha256(first) == body_sha256(reordered)
    changed = JobSpec.model_validate({**_SPEC, "train": {"steps": 3, "batch_size": 4}})
    assert body_sha256(changed) != body_sha256(first)
    # A default given explicitly is part of what the caller sent: another body.
    explicit = JobSpec.model_validate({**_SPEC, "engine": {"num_microbatch": 4}})
    assert body_sha256(explicit) != body_sha256(first)


def test_an_openai_create_hashes_by_the_same_rule() -> None:
    a = FineTuningJobCreate.model_validate({"model": "qwen3", "training_file": "file-1"})
    b = FineTuningJobCreate.model_validate({"training_file": "file-1", "model": "qwen3"})
    assert body_sha256(a) == body_sha256(b)
    assert len(body_sha256(a)) == 64


def test_no_second_hash_is_left() -> None:
    for module, name in [
        ("rp_service.jobs.orchestrator", "_spec_sha256"),
        ("rp_service.openai.fine_tuning", "_body_sha256"),
    ]:
        assert not hasattr(importlib.import_module(module), name), (module, name)
