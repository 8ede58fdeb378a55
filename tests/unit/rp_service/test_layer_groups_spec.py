"""engine.layers_per_group: validated at the edge, planned at submission (and offered
when it would fit), and the worker's RoundPipe runs its groups."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engine import ModelExecutePlan
from rp_service.app import create_app
from rp_service.errors import HostMemoryExceeded
from rp_service.jobs.hostmem import check_spec, plan_for_spec
from rp_service.schemas import JobSpec
from rp_service.settings import Settings
from rp_service.spec_to_engine import spec_to_engine
from tests.unit.engine.adapters.test_nf4 import LLAMA_70B
from tests.unit.rp_service.test_one_catalog import AUTH, LOOPBACK, _spec

GIB = 1 << 30


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(data_dir=tmp_path, gpus="none", host_memory_budget="160GiB", token="tok")
    with TestClient(create_app(settings), base_url=LOOPBACK, headers=AUTH) as c:
        yield c


def _qlora_70b(**engine: Any) -> JobSpec:
    """A Llama-3.3-70B QLoRA job at 16 x 2048 tokens a step, attention recomputed."""
    config = {k: v for k, v in LLAMA_70B.items() if k != "model_type"}
    return JobSpec.model_validate(
        _spec(
            model={"preset": "llama", "config": config, "dtype": "bfloat16", "quantization": "nf4"},
            data={"seq_len": 2048},
            train={"method": "lora", "batch_size": 16},
            engine={"gpus": 1, "pin_model": "arena", "recompute_attention": True, **engine},
        )
    )


def test_the_groups_reach_the_plan_and_the_engine_options() -> None:
    auto, two = _qlora_70b(), _qlora_70b(layers_per_group=2)
    assert spec_to_engine(auto).layers_per_group is None
    assert spec_to_engine(two).layers_per_group == 2
    auto_plan = plan_for_spec(auto, spec_to_engine(auto), path_config=None, cuda=True)
    two_plan = plan_for_spec(two, spec_to_engine(two), path_config=None, cuda=True)
    assert auto_plan is not None and two_plan is not None
    # 80 one-layer groups' inputs against 39 (82 layers in groups of two, less the tail and
    # the embedding's): 40 GiB against 19.5
    assert auto_plan.parts["activations"] == 80 * GIB // 2
    assert two_plan.parts["activations"] == 39 * GIB // 2
    assert two_plan.total_bytes < auto_plan.total_bytes


def test_a_refused_job_is_told_the_groups_that_fit() -> None:
    spec = _qlora_70b()
    two = _qlora_70b(layers_per_group=2)
    need_two = plan_for_spec(two, spec_to_engine(two), path_config=None, cuda=True)
    assert need_two is not None
    with pytest.raises(HostMemoryExceeded) as refused:
        check_spec(
            spec, spec_to_engine(spec), path_config=None, cuda=True, budget=need_two.total_bytes
        )
    offered = {o["param"]: o["change"] for o in refused.value.details["options"]}
    assert "layers_per_group=2" in offered["engine.layers_per_group"]
    # and the job that takes the advice fits
    check_spec(two, spec_to_engine(two), path_config=None, cuda=True, budget=need_two.total_bytes)


@pytest.mark.parametrize("value", [0, -1, "two", 1.5])
def test_a_bad_group_size_is_422_naming_the_field(client: TestClient, value: Any) -> None:
    r = client.post("/v1/jobs", json=_spec(engine={"layers_per_group": value}))
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == "engine.layers_per_group"


def test_the_worker_runs_the_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's RoundPipe gets grouped plans over its own layer count, and trains."""
    import torch

    from engine.models import causal_lm_loss_fn
    from rp_service.worker import engine_setup
    from tests.unit.engine.models.test_models import batch, tiny_model

    monkeypatch.setenv("RP_DEVICES", "cpu:2")
    from engine.device import reset_devices

    reset_devices()
    try:
        for size, expected in ((None, None), (2, ModelExecutePlan.grouped(5, 2))):
            spec = JobSpec.model_validate(_spec(engine={"layers_per_group": size}))
            rp = engine_setup.wrap(tiny_model("qwen3", layers=3), spec_to_engine(spec))
            got = rp.model_run_config.execute_plan
            assert repr(got) == repr(expected)
            ids, labels = batch(3)
            loss = rp.forward_backward(
                input_kwargs={"input_ids": ids}, label=labels, loss_fn=causal_lm_loss_fn(labels)
            )
            rp.synchronize()
            assert torch.isfinite(loss)
            grads = [p.grad for p in rp.model.parameters() if p.requires_grad]
            assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    finally:
        monkeypatch.delenv("RP_DEVICES")
        reset_devices()
