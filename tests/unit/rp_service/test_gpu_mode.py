"""engine.gpu_mode: the auto rule's choices (rp_service.jobs.gpu_mode), the 422 of an
explicit `ranks` that cannot run, the choice kept in the job object, the local launcher's
rank environments and the follow loop it shares with the Ray driver."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rp_service.app import create_app
from rp_service.cluster.follow import RankLost, Signals, follow_ranks
from rp_service.cluster.local import rank_envs
from rp_service.errors import HostMemoryExceeded, InvalidRequest
from rp_service.jobs.resolve import SpecResolver
from rp_service.schemas import JobSpec
from rp_service.settings import Settings
from rp_service.spec_to_engine import spec_to_engine
from rp_service.worker.main import EXIT_FAILED, EventWriter

TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
}


def _body(*, train: dict[str, Any] | None = None, **engine: Any) -> dict[str, Any]:
    return {
        "model": {"preset": "qwen3", "config": TINY},
        "data": {"train": "synthetic", "seq_len": 64},
        "train": {"steps": 2, "batch_size": 8, **(train or {})},
        "engine": {"gpus": 2, **engine},
    }


def _mode(tmp_path: Path, body: dict[str, Any], *, budget: str = "64GiB", gpu_count: int = 2):
    resolver = SpecResolver(Settings(data_dir=tmp_path, host_memory_budget=budget), None)
    spec = JobSpec.model_validate(body)
    return resolver.gpu_mode(spec, spec_to_engine(spec), gpu_count=gpu_count)


def test_auto_takes_ranks_on_four_gpus_when_the_copies_fit(tmp_path: Path) -> None:
    four = _mode(tmp_path, _body(gpus=4, step_staleness=1), gpu_count=4)
    assert (four.mode, four.ranks) == ("ranks", 4)
    assert "outrun one process" in four.reason
    # on 2 (and 3) GPUs one process with overlapped calls measured faster
    two = _mode(tmp_path, _body(step_staleness=1))
    assert (two.mode, two.ranks) == ("pipeline", 1)
    assert "overlapped calls outruns ranks" in two.reason and "'ranks'" in two.reason
    three = _mode(tmp_path, _body(gpus=3, step_staleness=1, train={"batch_size": 12}), gpu_count=3)
    assert three.mode == "pipeline"


def test_auto_keeps_one_process_where_the_step_waits_for_the_collectives(tmp_path: Path) -> None:
    """The default step (staleness zero) and a synchronous one: the pipeline, saying why and
    how to take ranks anyway; asked for, ranks still run."""
    default = _mode(tmp_path, _body())
    assert default.mode == "pipeline" and "engine.step_staleness 0" in default.reason
    assert "engine.gpu_mode 'ranks'" in default.reason
    sync = _mode(tmp_path, _body(async_step=False, step_staleness=1))
    assert sync.mode == "pipeline" and "engine.async_step false" in sync.reason
    assert _mode(tmp_path, _body(gpu_mode="ranks")).mode == "ranks"


def test_auto_falls_back_to_the_pipeline_and_says_why(tmp_path: Path) -> None:
    # a CUDA process's runtime is planned at 4 GiB (the tiny model's own bytes are a few
    # MiB): one process fits 6 GiB, two ranks do not
    small = _mode(tmp_path, _body(gpus=4, step_staleness=1), budget="6GiB", gpu_count=4)
    assert small.mode == "pipeline" and small.ranks == 1
    assert "4 copies of the model in host memory" in small.reason
    lora = _mode(tmp_path, _body(train={"method": "lora"}))
    assert lora.mode == "pipeline" and "train.method 'lora'" in lora.reason
    dpo = _mode(tmp_path, _body(train={"objective": "dpo"}))
    assert dpo.mode == "pipeline" and "train.objective 'dpo'" in dpo.reason
    odd = _mode(tmp_path, _body(train={"batch_size": 9}))
    assert odd.mode == "pipeline" and "does not split into 2" in odd.reason
    # 2 rows a rank, 4 micro-batches each: a rank cannot fill them
    thin = _mode(tmp_path, _body(train={"batch_size": 4}, num_microbatch=4))
    assert thin.mode == "pipeline" and "fewer than its 4 micro-batches" in thin.reason
    one = _mode(tmp_path, _body(gpus=1))
    assert one.mode == "pipeline" and "engine.gpus is 1" in one.reason
    cpu = _mode(tmp_path, _body(), gpu_count=0)
    assert cpu.mode == "pipeline" and "no GPUs" in cpu.reason
    asked = _mode(tmp_path, _body(gpu_mode="pipeline"))
    assert asked.mode == "pipeline" and "'pipeline'" in asked.reason


def test_explicit_ranks_run_where_they_can_and_are_refused_naming_the_field(
    tmp_path: Path,
) -> None:
    assert _mode(tmp_path, _body(gpu_mode="ranks")).mode == "ranks"
    # on CPU devices too (one cpu:1 device a rank, gloo): what the CI tests run
    assert _mode(tmp_path, _body(gpu_mode="ranks"), gpu_count=0).ranks == 2
    for body, budget, words in (
        (_body(gpu_mode="ranks", train={"method": "lora"}), "64GiB", "train.method 'lora'"),
        (_body(gpu_mode="ranks"), "6GiB", "host memory"),
        (_body(gpu_mode="ranks", gpus=1), "64GiB", "at least 2 GPUs"),
        (_body(gpu_mode="ranks", train={"batch_size": 3}), "64GiB", "does not split"),
    ):
        with pytest.raises(InvalidRequest) as exc:
            _mode(tmp_path, body, budget=budget)
        assert exc.value.param == "engine.gpu_mode"
        assert words in exc.value.message and "set engine.gpu_mode to 'auto'" in exc.value.message


def _overlap(
    tmp_path: Path, body: dict[str, Any], *, budget: str = "64GiB", gpu_count: int = 2
) -> tuple[bool, bool]:
    """(the options' overlap_calls, the mode's) as the orchestrator decides them."""
    resolver = SpecResolver(Settings(data_dir=tmp_path, host_memory_budget=budget), None)
    spec = JobSpec.model_validate(body)
    options = spec_to_engine(spec)
    mode = resolver.gpu_mode(spec, options, gpu_count=gpu_count)
    options, mode = resolver.overlap_calls(spec, options, mode, gpu_count=gpu_count)
    return options.overlap_calls, mode.overlap_calls


def test_auto_overlaps_one_process_on_several_gpus_at_staleness_one(tmp_path: Path) -> None:
    assert _overlap(tmp_path, _body(step_staleness=1)) == (True, True)
    assert _overlap(tmp_path, _body(step_staleness=1, train={"method": "lora"})) == (True, True)
    for body, gpu_count in (
        (_body(), 2),  # staleness zero: the next forward waits for the step anyway
        (_body(async_step=False, step_staleness=1), 2),
        (_body(gpus=1, step_staleness=1), 2),
        (_body(step_staleness=1), 0),  # CPU devices: nothing to hide
        (_body(step_staleness=1, train={"objective": "dpo"}), 2),
        (_body(step_staleness=1, overlap_calls=False), 2),
        (_body(step_staleness=1, gpu_mode="ranks"), 2),
        (_body(gpus=4, step_staleness=1), 4),  # ranks on 4
    ):
        assert _overlap(tmp_path, body, gpu_count=gpu_count) == (False, False), body


def test_auto_overlaps_only_where_the_second_calls_memory_fits(tmp_path: Path) -> None:
    """Overlapped calls hold two calls' activations and a second weight copy: a budget
    the plain plan fits but the overlapped one does not keeps calls one after the other."""
    from rp_service.jobs.hostmem import plan_for_spec

    body = _body(step_staleness=1, train={"batch_size": 64})
    body["data"]["seq_len"] = 2048
    body["model"]["config"] = {**TINY, "max_position_embeddings": 2048}
    spec = JobSpec.model_validate(body)
    options = spec_to_engine(spec)
    plain = plan_for_spec(spec, options, path_config=None, cuda=True).total_bytes
    doubled = plan_for_spec(
        spec, replace(options, overlap_calls=True), path_config=None, cuda=True
    ).total_bytes
    assert doubled > plain
    between = f"{(plain + doubled) // 2}"
    assert _overlap(tmp_path, body, budget=between) == (False, False)
    assert _overlap(tmp_path, body, budget=f"{doubled}") == (True, True)
    # asked for where it does not fit: the refusal names the field and the figures
    with pytest.raises(HostMemoryExceeded) as exc:
        _overlap(
            tmp_path, {**body, "engine": {**body["engine"], "overlap_calls": True}}, budget=between
        )
    assert exc.value.param == "engine.overlap_calls" and exc.value.code == "host_memory_exceeded"
    assert "set engine.overlap_calls to 'auto' or false" in exc.value.message


def test_explicit_overlap_is_refused_where_it_cannot_run_naming_the_field(tmp_path: Path) -> None:
    assert _overlap(tmp_path, _body(overlap_calls=True)) == (True, True)  # staleness 0 too
    assert _overlap(tmp_path, _body(overlap_calls=True), gpu_count=0) == (True, True)
    for body, gpu_count, words in (
        (_body(overlap_calls=True, gpu_mode="ranks"), 2, "data-parallel ranks"),
        (_body(overlap_calls=True, nodes=2), 2, "engine.nodes 2"),
        (_body(overlap_calls=True, train={"objective": "dpo"}), 2, "'dpo'"),
        (_body(overlap_calls=True, optim_memory="compact"), 2, "compact"),
    ):
        if "compact" in words:
            body["model"]["dtype"] = "bfloat16"
        with pytest.raises(InvalidRequest) as exc:
            _overlap(tmp_path, body, gpu_count=gpu_count)
        assert (
            exc.value.param == "engine.overlap_calls" and exc.value.code == "overlap_not_possible"
        )
        assert words in exc.value.message


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(data_dir=tmp_path, gpus="none", host_memory_budget="64GiB", auth="none")
    with TestClient(create_app(settings), base_url="http://127.0.0.1:8321") as c:
        yield c


def test_the_job_object_says_which_mode_and_why(client: TestClient) -> None:
    r = client.post("/v1/jobs", json=_body(gpu_mode="ranks", train={"method": "lora"}))
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == "engine.gpu_mode"
    assert r.json()["error"]["code"] == "ranks_not_possible"
    r = client.post("/v1/jobs", json={**_body(), "priority": -5})
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    client.post(f"/v1/jobs/{job_id}/pause")
    shown = client.get(f"/v1/jobs/{job_id}").json()["gpu_mode"]
    assert shown["mode"] == "pipeline" and "no GPUs" in shown["reason"]
    assert shown["overlap_calls"] is False
    client.post(f"/v1/jobs/{job_id}/cancel")
    r = client.post("/v1/jobs", json={**_body(overlap_calls=True), "priority": -5})
    assert r.status_code == 201, r.text
    assert r.json()["gpu_mode"]["overlap_calls"] is True
    client.post(f"/v1/jobs/{r.json()['id']}/cancel")
    r = client.post("/v1/jobs", json=_body(overlap_calls=True, train={"objective": "dpo"}))
    assert r.status_code == 422 and r.json()["error"]["param"] == "engine.overlap_calls"


def test_each_local_rank_sees_one_gpu_or_one_cpu_device() -> None:
    envs = rank_envs(2, "3,5", "cuda", 29511)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3", "5"]
    assert [(e["RANK"], e["WORLD_SIZE"], e["RP_DEVICES"]) for e in envs] == [
        ("0", "2", "cuda"),
        ("1", "2", "cuda"),
    ]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {("127.0.0.1", "29511")}
    cpu = rank_envs(3, "", "cpu:4", 1)
    assert [e["RP_DEVICES"] for e in cpu] == ["cpu:1"] * 3
    assert all(e["CUDA_VISIBLE_DEVICES"] == "" for e in cpu)
    with pytest.raises(ValueError, match="one GPU each"):
        rank_envs(2, "0", "cuda", 1)


class _Rank:
    """A scripted rank: the takes it answers, in order (the last one repeats)."""

    def __init__(self, takes: list[Any]) -> None:
        self.takes = takes
        self.signals: list[int] = []
        self.killed = False

    def take(self) -> tuple[list[str], list[str], int | None]:
        answer = self.takes.pop(0) if len(self.takes) > 1 else self.takes[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def signal(self, signum: int) -> None:
        self.signals.append(signum)

    def kill(self) -> None:
        self.killed = True


class _Out:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, text: str) -> int:
        self.lines += [line for line in text.splitlines() if line]
        return len(text)

    def flush(self) -> None:
        pass


def _follow(
    ranks: list[_Rank], *, pause: bool = False, grace_s: float = 0.0, one_device_each: bool = False
) -> tuple[int, list[Any], list[_Rank]]:
    out = _Out()
    emit = EventWriter(out)  # type: ignore[arg-type]
    failures: list[Any] = []

    def fail(code: str, message: str, param: str | None) -> int:
        failures.append((code, message, param))
        return EXIT_FAILED

    signals = Signals.__new__(Signals)  # no handlers installed: the test sets the flags
    signals.cancel, signals.pause = False, pause
    code = follow_ranks(
        ranks, emit, signals, fail, grace_s=grace_s, one_device_each=one_device_each
    )
    return code, failures + out.lines, ranks


def test_rank_zero_speaks_for_the_job_and_signals_reach_every_rank() -> None:
    event = json.dumps({"type": "status", "message": "paused"})
    code, seen, ranks = _follow(
        [_Rank([([event], ["r0 log"], None), ([], [], 75)]), _Rank([([], [], 75)])], pause=True
    )
    assert code == 75 and seen == [event]
    assert [r.signals for r in ranks] == [[signal.SIGUSR1], [signal.SIGUSR1]]
    assert all(r.killed for r in ranks)  # whatever is left of them


def test_a_failed_rank_fails_the_attempt_with_its_own_error() -> None:
    error = json.dumps(
        {"level": "error", "data": {"code": "out_of_memory", "message": "OOM", "param": "x"}}
    )
    code, seen, ranks = _follow([_Rank([([], [], None)]), _Rank([([error], [], EXIT_FAILED)])])
    assert code == EXIT_FAILED
    assert seen[0] == ("out_of_memory", "rank 1: OOM", "x")
    assert all(r.killed for r in ranks)
    killed = _follow([_Rank([([], [], None)]), _Rank([([], [], -signal.SIGKILL)])])[1]
    assert killed[0] == ("node_lost", "rank 1 was killed by signal 9", None)
    lost = _follow([_Rank([([], [], None)]), _Rank([RankLost("the node left")])])[1]
    assert lost[0] == ("node_lost", "the node left", None)


def test_rank_zero_failing_after_a_killed_peer_is_the_retryable_node_lost() -> None:
    broken = json.dumps({"level": "error", "data": {"code": "internal_error", "message": "gloo"}})
    code, seen, _ = _follow(
        [
            _Rank([([], [], None), ([broken], [], EXIT_FAILED)]),
            _Rank([([], [], -signal.SIGKILL)]),
        ],
        grace_s=30.0,  # rank 0 ends within it, with its own error
    )
    assert code == EXIT_FAILED
    assert seen[0] == ("node_lost", "rank 1 was killed by signal 9", None)
    # rank 0 paused or cancelled meanwhile: its status stands
    assert _follow([_Rank([([], [], 75)]), _Rank([([], [], -signal.SIGKILL)])])[0] == 75


def _metrics(step: int, busy: float) -> str:
    share = [{"device": "cuda:0", "busy_fraction": busy, "jobs": 3}]
    return json.dumps({"type": "metrics", "data": {"step": step, "gpu_share": share}})


def test_rank_zero_metrics_carry_every_ranks_gpu_share_as_the_jobs_gpus() -> None:
    ranks = [
        _Rank([([], [], None), ([_metrics(1, 0.9)], [], 0)]),
        _Rank([([_metrics(1, 0.5)], [], None), ([], [], 0)]),
    ]
    code, seen, _ = _follow(ranks, grace_s=5.0, one_device_each=True)
    assert code == 0
    share = json.loads(seen[0])["data"]["gpu_share"]
    assert [(d["device"], d["busy_fraction"]) for d in share] == [("cuda:0", 0.9), ("cuda:1", 0.5)]
    # the Ray driver's ranks (several devices a node): rank 0's line as it is
    ranks = [
        _Rank([([], [], None), ([_metrics(1, 0.9)], [], 0)]),
        _Rank([([_metrics(1, 0.5)], [], None), ([], [], 0)]),
    ]
    assert _follow(ranks, grace_s=5.0)[1] == [_metrics(1, 0.9)]
