"""The multi-node pieces that need no Ray cluster: the submission rules of engine.nodes,
the one-box path's imports, the rank agent's process handling, and the sharded checkpoint
(rp_service.cluster, rp_service.worker.ranks)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rp_service.cluster.agent import RankAgent
from rp_service.cluster.driver import _needed_paths, _stage_inputs
from rp_service.cluster.nodes import check_nodes_request
from rp_service.errors import InvalidRequest
from rp_service.schemas import JobSpec
from rp_service.settings import Settings
from rp_service.worker import checkpoint as ckpt
from rp_service.worker.ranks import Ranks, shard_names

REPO = Path(__file__).resolve().parents[3]


def _spec(**engine: Any) -> JobSpec:
    return JobSpec.model_validate(
        {
            "model": {"preset": "qwen3"},
            "data": {"train": "synthetic"},
            "train": {"batch_size": 4},
            "engine": {"gpus": 0, **engine},
        }
    )


def _param(exc: pytest.ExceptionInfo[InvalidRequest]) -> str | None:
    return exc.value.param


def test_several_nodes_without_a_ray_cluster_is_refused_naming_the_field(tmp_path) -> None:
    settings = Settings(data_dir=tmp_path)
    check_nodes_request(_spec(nodes=1), settings)  # one box: nothing to check
    with pytest.raises(InvalidRequest, match="RP_RAY_ADDRESS is unset") as exc:
        check_nodes_request(_spec(nodes=2), settings)
    assert _param(exc) == "engine.nodes" and exc.value.code == "no_cluster"
    no_shared = Settings(data_dir=tmp_path, ray_address="auto")
    with pytest.raises(InvalidRequest, match="RP_SHARED_DIR") as exc:
        check_nodes_request(_spec(nodes=2), no_shared)
    assert _param(exc) == "engine.nodes"
    ready = Settings(data_dir=tmp_path, ray_address="auto", shared_dir=tmp_path / "s")
    check_nodes_request(_spec(nodes=2), ready)
    with pytest.raises(InvalidRequest) as exc:
        check_nodes_request(_spec(nodes=3), ready)  # 4 rows over 3 ranks
    assert _param(exc) == "train.batch_size"


def test_job_directories_move_to_the_shared_folder_only_with_a_cluster(tmp_path) -> None:
    assert Settings(data_dir=tmp_path).jobs_dir == tmp_path / "jobs"
    alone = Settings(data_dir=tmp_path, shared_dir=tmp_path / "s")
    assert alone.jobs_dir == tmp_path / "jobs"
    cluster = Settings(data_dir=tmp_path, ray_address="auto", shared_dir=tmp_path / "s")
    assert cluster.jobs_dir == tmp_path / "s" / "jobs"


def test_the_one_box_daemon_and_worker_never_import_ray(tmp_path) -> None:
    code = (
        "import sys\n"
        "from rp_service.app import create_app\n"
        "from rp_service.settings import Settings\n"
        f"create_app(Settings(data_dir={str(tmp_path)!r}))\n"
        "import rp_service.worker.main, rp_service.worker.training, rp_service.cluster.rank\n"
        "import rp_service.cluster.driver, rp_service.jobs.orchestrator\n"
        "print('ray' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_a_node_without_a_folder_is_named_by_its_field(tmp_path) -> None:
    resolved = {"model_path": str(tmp_path / "model"), "tokenizer_path": None}
    needed = _needed_paths(tmp_path, resolved)
    assert needed == {"RP_SHARED_DIR": str(tmp_path), "model.path": str(tmp_path / "model")}
    assert RankAgent().missing(needed) == {"model.path": str(tmp_path / "model")}
    (tmp_path / "model").mkdir()
    assert RankAgent().missing(needed) == {}


def test_datasets_outside_the_shared_folder_are_staged_into_the_job(tmp_path) -> None:
    shared, job_dir = tmp_path / "shared", tmp_path / "shared" / "jobs" / "job-1"
    job_dir.mkdir(parents=True)
    outside = tmp_path / "files" / "file-1.jsonl"
    outside.parent.mkdir()
    outside.write_text('{"text": "hi"}\n')
    inside = shared / "valid.jsonl"
    inside.write_text('{"text": "yo"}\n')
    payload = {"resolved": {"train_path": str(outside), "valid_path": str(inside)}}
    assert _stage_inputs(job_dir, payload, shared)
    staged = Path(payload["resolved"]["train_path"])
    assert staged == job_dir / "inputs" / "train.jsonl"
    assert staged.read_text() == outside.read_text()
    assert payload["resolved"]["valid_path"] == str(inside)  # every node sees it already
    assert not _stage_inputs(job_dir, payload, shared)


def test_the_agent_passes_lines_and_the_exit_status_on(tmp_path, monkeypatch) -> None:
    fake = tmp_path / "rp_service" / "cluster"
    fake.mkdir(parents=True)
    (tmp_path / "rp_service" / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "rank.py").write_text(
        "import sys, os\n"
        'print(\'{"type": "log"}\', flush=True)\n'
        "print('rank', os.environ['RANK'], sys.argv[1], file=sys.stderr, flush=True)\n"
        "sys.exit(75)\n"
    )
    monkeypatch.chdir(tmp_path)  # `-m` looks in the working directory first
    agent = RankAgent()
    agent.start("JOB", {"RANK": "1", "PYTHONPATH": str(tmp_path)})
    out: list[str] = []
    err: list[str] = []
    code = None
    deadline = time.monotonic() + 30
    while code is None and time.monotonic() < deadline:
        o, e, code = agent.take()
        out += o
        err += e
        time.sleep(0.05)
    assert code == 75
    assert out == ['{"type": "log"}'] and err == ["rank 1 JOB"]


def test_a_single_process_has_no_collectives_and_no_shards(tmp_path) -> None:
    ranks = Ranks.current()
    assert (ranks.rank, ranks.world) == (0, 1)
    assert ranks.any(True) and not ranks.any(False)
    assert shard_names(3) == ("rank-00003.shard", "rank-00003.json")
    masters = [torch.nn.Parameter(torch.ones(3))]
    optimizer = torch.optim.AdamW(masters)
    assert ranks.write_shard(tmp_path, 5, masters, optimizer) == []
    assert not ranks.staging_dir(tmp_path, 5).exists()


def test_a_checkpoint_from_other_ranks_is_refused_naming_engine_nodes(tmp_path) -> None:
    from rp_service.errors import JobFailure

    masters = [torch.nn.Parameter(torch.arange(4.0))]
    optimizer = torch.optim.AdamW(masters)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    staging = tmp_path / ".tmp-shards-00000002"
    staging.mkdir()
    for name in shard_names(1):
        (staging / name).write_bytes(b"x")
    path, _ = ckpt.save_training_checkpoint(
        tmp_path,
        2,
        model={"w": torch.zeros(4)},
        masters=list(masters),
        optimizer=optimizer,
        scheduler=scheduler,
        progress={},
        config_json=b"{}",
        keep=2,
        shards=sorted(staging.iterdir()),
    )
    state = json.loads((path / ckpt.STATE_FILE).read_text())
    assert state["world_size"] == 2 and (path / "rank-00001.shard").is_file()
    with pytest.raises(JobFailure, match="written by 2 rank") as exc:
        Ranks().read(ckpt.latest_checkpoint(tmp_path))
    assert exc.value.param == "engine.nodes"


def test_an_unreachable_cluster_is_a_503_not_a_crash(tmp_path, monkeypatch) -> None:
    from rp_service.cluster.nodes import ClusterView
    from rp_service.errors import NotReady

    view = ClusterView(Settings(data_dir=tmp_path, ray_address="10.255.255.1:6379"))

    def down() -> list[dict[str, Any]]:
        raise ConnectionError("no GCS at 10.255.255.1:6379")

    monkeypatch.setattr(view, "nodes", down)
    with pytest.raises(NotReady, match="cannot be reached") as exc:
        view.check(_spec(nodes=2))
    assert exc.value.status_code == 503 and exc.value.code == "cluster_unreachable"


def test_a_queued_multi_node_job_without_a_cluster_fails_at_start_naming_the_field(
    tmp_path,
) -> None:
    from rp_service.jobs.resolve import SpecResolver

    resolver = SpecResolver(Settings(data_dir=tmp_path), store=None)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest) as exc:
        resolver.resolve(_spec(nodes=2), tmp_path / "job")
    assert exc.value.param == "engine.nodes"
    ready = Settings(data_dir=tmp_path, ray_address="auto", shared_dir=tmp_path / "s")
    resolved = SpecResolver(ready, store=None).resolve(_spec(nodes=2), tmp_path / "job")  # type: ignore[arg-type]
    assert resolved["ray_address"] == "auto" and resolved["shared_dir"] == str(tmp_path / "s")
