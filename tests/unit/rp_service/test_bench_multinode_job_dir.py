"""bench/multinode.py writes the job folder the rank entry point reads: the same spec.json as
the daemon's (the engine options included), so the device's multi-node figure and
tests/gpu/test_multinode_gpu.py do not fail on a format the CI never read (they did once:
`'options'` missing after the options moved into spec.json). Both benches build their job
from bench/service_train.py's `job_spec`, which once read options only its own command line
has (`gpu_mode`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.multinode import write_job_dir
from bench.service_train import job_spec
from engine.options import EngineOptions
from rp_service.schemas import JobSpec
from rp_service.worker.training import JobPaths


def test_the_job_dir_reads_as_the_worker_reads_it(tmp_path: Path) -> None:
    args = argparse.Namespace(
        model="tiny", gpu=False, seq_len=64, seqs_per_node=4, num_microbatch=2,
        steps=3, warmup=1, network=False, timeout_s=60.0,
    )  # fmt: skip
    write_job_dir(tmp_path / "job", args, nodes=2)
    payload = json.loads((tmp_path / "job" / "spec.json").read_text())
    spec = JobSpec.model_validate(payload["spec"])
    options = EngineOptions.from_json(payload["options"])
    paths = JobPaths.from_json(payload["resolved"])
    assert spec.engine.nodes == 2
    assert spec.engine.step_staleness == 0  # the service's default step is what it measures
    assert options.num_microbatch == 2
    assert paths.output_dir == tmp_path / "job" / "output"


def test_the_service_bench_asks_for_its_gpus_mode_and_step() -> None:
    args = argparse.Namespace(
        model="qwen3-1.7b", seq_len=2048, seqs_per_step=128, num_microbatch=8, steps=4,
        warmup=3, gpus=2, gpu_mode="ranks", step_staleness=1,
    )  # fmt: skip
    engine = JobSpec.model_validate(job_spec(args)).engine
    assert (engine.gpus, engine.gpu_mode, engine.step_staleness) == (2, "ranks", 1)
