"""The `rp` commands over a MockTransport-backed client: output and exit codes."""

from __future__ import annotations

import json

import httpx
import pytest
from rp_client.cli import app
from typer.testing import CliRunner

from ._fakes import error_response, event_obj, job_obj, sse_body

SSE = {"content-type": "text/event-stream"}


@pytest.fixture
def rp(make_client):
    def invoke(handler, *args, **kwargs):
        client, rec = make_client(handler, max_retries=0)
        result = CliRunner().invoke(app, list(args), obj={"client": client}, **kwargs)
        result.requests = rec.requests
        return result

    return invoke


def page(data):
    return {"object": "list", "data": data, "has_more": False, "first_id": None, "last_id": None}


def follow_handler(final_status, *, error=None, output=None):
    events = [
        event_obj(1, type="status", status="running", previous="queued"),
        event_obj(
            2, step=1, total_steps=3, train_loss=2.5, tokens_per_second=1000.0, eta_seconds=2.0
        ),
        event_obj(
            3, step=3, total_steps=3, train_loss=1.25, tokens_per_second=1200.0, eta_seconds=0.0
        ),
        event_obj(4, type="status", status=final_status, previous="running"),
    ]

    def handler(request):
        if request.url.path.endswith("/events"):
            return httpx.Response(200, content=sse_body(events, done=final_status), headers=SSE)
        if request.method == "POST":
            return httpx.Response(201, json=job_obj())
        return httpx.Response(
            200, json=job_obj(status=final_status, error=error, output_model_path=output)
        )

    return handler


def test_submit_prints_the_job_id(rp, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("train:\n  steps: 3\n")
    result = rp(lambda r: httpx.Response(201, json=job_obj()), "submit", str(spec), "--name", "x")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "job-1"
    assert json.loads(result.requests[0].content) == {"train": {"steps": 3}, "name": "x"}


def test_submit_bad_spec_file_is_a_usage_error(rp, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("- just\n- a list\n")
    result = rp(lambda r: httpx.Response(201, json=job_obj()), "submit", str(spec))
    assert result.exit_code == 2
    assert "must be a mapping" in result.stderr
    assert result.requests == []


def test_submit_validation_error_is_one_line_exit_2(rp, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("train:\n  lr: -1\n")
    result = rp(
        lambda r: error_response(422, "invalid_request_error", "must be > 0", param="train.lr"),
        "submit",
        str(spec),
    )
    assert result.exit_code == 2
    assert result.stderr == "error: train.lr: must be > 0\n"
    assert "Traceback" not in result.output


def test_submit_follow_succeeds_with_exit_0(rp, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("train:\n  steps: 3\n")
    result = rp(
        follow_handler("succeeded", output="/data/models/job-1"), "submit", str(spec), "--follow"
    )
    assert result.exit_code == 0, result.output
    assert "job-1 succeeded; model: /data/models/job-1" in result.stdout
    assert "queued -> running" in result.stderr


def test_follow_failed_job_exits_1_with_the_reason(rp):
    error = {"code": "oom", "message": "out of memory on cuda:0", "param": None}
    result = rp(follow_handler("failed", error=error), "follow", "job-1")
    assert result.exit_code == 1
    assert "job-1 failed: out of memory on cuda:0" in result.stderr


def test_follow_cancelled_job_exits_1(rp):
    result = rp(follow_handler("cancelled"), "follow", "job-1")
    assert result.exit_code == 1


def test_follow_json_prints_one_event_per_line(rp):
    result = rp(follow_handler("succeeded"), "follow", "job-1", "--json")
    assert result.exit_code == 0
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [e["id"] for e in lines] == [1, 2, 3, 4]
    assert lines[1]["data"]["train_loss"] == 2.5


def test_jobs_lists_a_table_and_json(rp):
    jobs = [job_obj("job-a", status="running", metrics={"train_loss": 1.5}), job_obj("job-b")]
    result = rp(lambda r: httpx.Response(200, json=page(jobs)), "jobs", "--status", "running")
    assert result.exit_code == 0
    assert "job-a" in result.stdout and "1.5000" in result.stdout and "job-b" in result.stdout
    assert result.requests[0].url.params["status"] == "running"
    result = rp(lambda r: httpx.Response(200, json=page(jobs)), "jobs", "--json", "-n", "1")
    assert [json.loads(line)["id"] for line in result.stdout.splitlines()] == ["job-a"]


def test_status_shows_the_job(rp):
    job = job_obj(status="failed", error={"code": "x", "message": "boom", "param": "data.train"})
    result = rp(lambda r: httpx.Response(200, json=job), "status", "job-1")
    assert result.exit_code == 0
    assert "failed" in result.stdout and "boom (data.train)" in result.stdout
    result = rp(lambda r: httpx.Response(200, json=job), "status", "job-1", "--json")
    assert json.loads(result.stdout)["status"] == "failed"


def test_status_unknown_job_is_exit_2(rp):
    result = rp(
        lambda r: error_response(404, "not_found_error", "no job named job-x"), "status", "job-x"
    )
    assert result.exit_code == 2
    assert result.stderr == "error: no job named job-x\n"


@pytest.mark.parametrize(
    ("command", "status"), [("cancel", "cancelling"), ("pause", "pausing"), ("resume", "queued")]
)
def test_lifecycle_commands(rp, command, status):
    result = rp(lambda r: httpx.Response(200, json=job_obj(status=status)), command, "job-1")
    assert result.exit_code == 0
    assert result.stdout == f"job-1 {status}\n"
    assert result.requests[0].url.path == f"/v1/jobs/job-1/{command}"


def test_illegal_transition_is_one_line(rp):
    result = rp(
        lambda r: error_response(
            409,
            "conflict_error",
            "job-1 is succeeded; cannot pause",
            headers={"x-should-retry": "false"},
        ),
        "pause",
        "job-1",
    )
    assert result.exit_code == 2
    assert result.stderr == "error: job-1 is succeeded; cannot pause\n"


def test_unreachable_daemon_is_exit_1(rp):
    def handler(request):
        raise httpx.ConnectError("refused", request=request)

    result = rp(handler, "jobs")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: connection to the RoundPipe daemon")
    assert "Traceback" not in result.output


def test_unauthorized_says_so(rp):
    result = rp(
        lambda r: error_response(401, "authentication_error", "missing bearer token"), "system"
    )
    assert result.exit_code == 2
    assert result.stderr == "error: missing bearer token\n"


def test_logs(rp):
    result = rp(lambda r: httpx.Response(200, text="line 1\nline 2\n"), "logs", "job-1")
    assert result.stdout == "line 1\nline 2\n"
    result = rp(lambda r: httpx.Response(200, text="x\n"), "logs", "job-1", "-f")
    assert result.stdout == "x\n" and result.requests[0].url.params["follow"] == "true"


def test_upload_and_files(rp, tmp_path):
    file = {
        "id": "file-9",
        "object": "file",
        "filename": "d.jsonl",
        "bytes": 10,
        "line_count": 1,
        "format": "text",
        "created_at": 1,
    }
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "x"}\n')

    def handler(request):
        if request.method == "POST":
            return httpx.Response(201, json=file)
        if request.method == "DELETE":
            return httpx.Response(200, json={"id": "file-9", "deleted": True})
        return httpx.Response(200, json=page([file]))

    assert rp(handler, "upload", str(data)).stdout == "file-9\n"
    assert "d.jsonl" in rp(handler, "files").stdout
    assert rp(handler, "files", "--delete", "file-9").stdout == "file-9 deleted\n"


def test_download_latest_checkpoint(rp, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpts = [{"object": "checkpoint", "job_id": "job-1", "step": s} for s in (5, 10)]

    def handler(request):
        if request.url.path.endswith("/content"):
            return httpx.Response(200, content=b"tar-bytes")
        return httpx.Response(200, json=page(ckpts))

    result = rp(handler, "download", "job-1")
    assert result.exit_code == 0, result.output
    assert result.stdout == "job-1-step10.tar\n"
    assert (tmp_path / "job-1-step10.tar").read_bytes() == b"tar-bytes"


def test_download_model_path(rp):
    job = job_obj(status="succeeded", output_model_path="/srv/rp/models/job-1")
    result = rp(lambda r: httpx.Response(200, json=job), "download", "job-1", "--model-path")
    assert result.stdout == "/srv/rp/models/job-1\n"
    result = rp(lambda r: httpx.Response(200, json=job_obj()), "download", "job-1", "--model-path")
    assert result.exit_code == 2 and "no trained model yet" in result.stderr


def test_system(rp):
    info = {
        "version": "0.1.0",
        "versions": {"torch": "2.13"},
        "devices": [{"name": "cpu"}],
        "host_memory_bytes": 2**34,
        "adam": {"isa": "avx2", "threads": 2},
        "queue_length": 1,
        "jobs": {"running": 1},
    }
    result = rp(lambda r: httpx.Response(200, json=info), "system")
    assert result.exit_code == 0
    assert "16.0 GiB" in result.stdout and "avx2, 2 threads" in result.stdout
    assert "gpu share" not in result.stdout  # an older daemon: no such field


def test_system_shows_each_gpus_job_and_share(rp):
    share = [
        {
            "gpu": 0,
            "device": "cuda:0",
            "job_id": "job-1",
            "busy_fraction": 0.934,
            "jobs": 12,
            "step": 7,
        },
        {
            "gpu": 1,
            "device": "cuda:1",
            "job_id": "job-1",
            "busy_fraction": None,
            "jobs": None,
            "step": None,
        },
        {
            "gpu": 2,
            "device": "cuda:2",
            "job_id": None,
            "busy_fraction": None,
            "jobs": None,
            "step": None,
        },
    ]
    info = {"version": "0.1.0", "versions": {}, "devices": [], "gpu_share": share}
    result = rp(lambda r: httpx.Response(200, json=info), "system")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    start = lines.index("gpu share        device, job, busy in its latest step")
    assert lines[start + 1 :] == [
        "  cuda:0         job-1   93% busy (step 7, 12 jobs)",
        "  cuda:1         job-1     - busy",
        "  cuda:2         free",
    ]


def test_serve_without_the_server_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr("rp_client.cli._daemon.importlib.util.find_spec", lambda name: None)
    result = CliRunner().invoke(app, ["serve"])
    assert result.exit_code == 1
    assert "pip install" in result.stderr and "rp_service" in result.stderr


def test_serve_turns_options_into_rp_settings(monkeypatch, tmp_path):
    started = {}

    def fake_exec(env):
        started.update(env)
        return 0

    monkeypatch.setattr("rp_client.cli.serve.server_installed", lambda: True)
    monkeypatch.setattr("rp_client.cli.serve.exec_daemon", fake_exec)
    result = CliRunner().invoke(
        app,
        [
            "serve",
            "--port",
            "9999",
            "--data-dir",
            str(tmp_path),
            "--gpus",
            "none",
            "--model-root",
            "/m1",
            "--model-root",
            "/m2",
        ],
    )
    assert result.exit_code == 0, result.output
    assert started["RP_PORT"] == "9999" and started["RP_GPUS"] == "none"
    assert started["RP_DATA_DIR"] == str(tmp_path.resolve())
    assert started["RP_MODEL_ROOTS"] == "/m1,/m2"


def test_demo_without_the_server_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr("rp_client.cli.demo.server_installed", lambda: False)
    result = CliRunner().invoke(app, ["demo"])
    assert result.exit_code == 1 and "not installed" in result.stderr


def test_usage_error_is_exit_2():
    assert CliRunner().invoke(app, ["status"]).exit_code == 2
    assert CliRunner().invoke(app, ["nope"]).exit_code == 2


def test_follow_lines_show_transitions_warnings_and_checkpoints_once():
    from rp_client import Event
    from rp_client.cli.progress import _describe

    def ev(type_, level="info", message="m", **data):
        return Event(id=1, job_id="job-1", type=type_, level=level, message=message, data=data)

    assert _describe(ev("status", status="running", previous="queued")) == (
        "job-1: queued -> running"
    )
    assert _describe(ev("message", message="running", status="running")) is None
    assert _describe(ev("message", "warning", "no GPUs")) == "job-1: warning: no GPUs"
    assert _describe(ev("checkpoint", step=50, path="/x")) == "job-1: checkpoint at step 50"
    assert _describe(ev("metrics", step=3, train_loss=1.0)) is None
    assert _describe(ev("metrics", step=3, valid_loss=0.5)) == "job-1: step 3 valid loss 0.5000"
    assert _describe(ev("log", message="noise")) is None
    assert _describe(ev("log", "error", "CUDA OOM")) == "job-1: error: CUDA OOM"


def test_follow_prints_each_sample_on_a_line_of_its_own_escaped():
    from rp_client import Event
    from rp_client.cli.progress import _describe

    samples = [
        {"prompt": "Tell me a story.", "completion": "once upon\na time", "tokens": 5},
        {"prompt": "2 + 2 =", "completion": "4\x1b[2J", "tokens": 2},
    ]
    event = Event(
        id=9, job_id="job-1", type="sample", message="m", data={"step": 20, "samples": samples}
    )
    assert _describe(event) == (
        "job-1: samples at step 20\n"
        "  Tell me a story. -> once upon\\na time\n"
        "  2 + 2 = -> 4\\x1b[2J"
    )


def test_metrics_shows_one_row_per_step_with_its_attempt(rp):
    body = {
        "object": "job.metrics",
        "job_id": "job-1",
        "columns": {
            "step": [1, 2, 3],
            "attempt": [1, 2, 2],
            "train_loss": [2.5, 2.0, 1.5],
            "valid_loss": [None, None, 1.75],
        },
    }
    result = rp(lambda r: httpx.Response(200, json=body), "metrics", "job-1", "--json")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert rows == [
        {"step": 1, "attempt": 1, "train_loss": 2.5, "valid_loss": None},
        {"step": 2, "attempt": 2, "train_loss": 2.0, "valid_loss": None},
        {"step": 3, "attempt": 2, "train_loss": 1.5, "valid_loss": 1.75},
    ]
    table = rp(lambda r: httpx.Response(200, json=body), "metrics", "job-1", "--last", "1")
    assert table.exit_code == 0 and table.requests[0].url.path == "/v1/jobs/job-1/metrics"
    lines = table.stdout.strip().splitlines()
    assert "ATTEMPT" in lines[0] and len(lines) == 2
    assert lines[1].split() == ["3", "2", "1.5", "1.75"]


def test_status_names_the_error_code_and_restarts(rp):
    error = {"code": "out_of_host_memory", "message": "out of host memory", "param": None}
    job = job_obj(status="failed", error=error, restarts=2)
    result = rp(lambda r: httpx.Response(200, json=job), "status", "job-1")
    assert "[out_of_host_memory] out of host memory" in result.stdout
    assert any(line.split() == ["restarts", "2"] for line in result.stdout.splitlines())


def _export_handler(request):
    body = json.loads(request.content)
    name = f"job-1-{body['type']}.gguf"
    return httpx.Response(
        200,
        json={
            "object": "export", "job_id": "job-1", "format": body["format"],
            "type": body["type"], "path": f"/srv/rp/jobs/job-1/export/{name}",
            "modelfile": "/srv/rp/jobs/job-1/export/Modelfile", "size_bytes": 1234,
        },
    )  # fmt: skip


def test_export_prints_the_gguf_and_the_ollama_step(rp):
    result = rp(_export_handler, "export", "job-1", "--type", "q8_0")
    assert result.exit_code == 0, result.output
    assert result.stdout == "/srv/rp/jobs/job-1/export/job-1-q8_0.gguf\n"
    assert "ollama create job-1 -f Modelfile" in result.stderr
    [request] = result.requests
    assert request.method == "POST" and request.url.path == "/v1/jobs/job-1/export"
    assert json.loads(request.content) == {"format": "gguf", "type": "q8_0"}
    refused = rp(
        lambda r: error_response(
            422, "invalid_request_error", "llama.cpp has no architecture", code="not_exportable"
        ),
        "export", "job-1",
    )  # fmt: skip
    assert refused.exit_code != 0 and "llama.cpp has no architecture" in refused.stderr


@pytest.mark.parametrize("dest", ["ckpts/", "a/b/"])
def test_download_into_a_folder_not_made_yet(rp, tmp_path, monkeypatch, dest):
    """A trailing slash names a folder: it is created and the tar lands inside it (it was
    written as a file named after the folder)."""
    monkeypatch.chdir(tmp_path)
    ckpts = [{"object": "checkpoint", "job_id": "job-1", "step": 100}]

    def handler(request):
        if request.url.path.endswith("/content"):
            return httpx.Response(200, content=b"tar-bytes")
        return httpx.Response(200, json=page(ckpts))

    result = rp(handler, "download", "job-1", "-o", dest)
    assert result.exit_code == 0, result.output
    assert (tmp_path / dest / "job-1-step100.tar").read_bytes() == b"tar-bytes"
    assert result.stdout == f"{dest}job-1-step100.tar\n"


def test_system_shows_the_cluster_nodes_and_their_jobs(rp):
    cluster = {
        "address": "10.0.0.1:6379",
        "nodes": [
            {
                "node_id": "a" * 56,
                "address": "10.0.0.1",
                "cpus": 16,
                "gpus": 2,
                "memory_bytes": 2**37,
                "jobs": ["job-1"],
            },
            {
                "node_id": "b" * 56,
                "address": "10.0.0.2",
                "cpus": 16,
                "gpus": 2,
                "memory_bytes": 2**37,
                "jobs": [],
            },
        ],
    }
    info = {"version": "0.1.0", "versions": {}, "devices": [], "cluster": cluster}
    result = rp(lambda r: httpx.Response(200, json=info), "system")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    start = lines.index("cluster          10.0.0.1:6379, 2 nodes")
    assert lines[start + 1 :] == [
        "  10.0.0.1       2 GPU, 16 CPU, 128.0 GiB  job-1",
        "  10.0.0.2       2 GPU, 16 CPU, 128.0 GiB  free",
    ]
