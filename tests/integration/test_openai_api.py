"""The official `openai` SDK against real daemons: one with the real worker (a tiny model
folder under RP_MODEL_ROOTS, trained on the CPU), one with the fake worker for the
lifecycle (cancel, pause, resume) and the retries."""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest

from tests.integration.service_daemon import Daemon, spec

TOKEN = "openai-test-token"
MODEL = "tiny-qwen3"
TERMINAL = {"succeeded", "failed", "cancelled"}


def _chat(i: int) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": f"What is {i} plus {i}?"},
            {"role": "assistant", "content": f"{2 * i}."},
        ]
    }


def _jsonl(records: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def _tiny_model(root: Path) -> None:
    """A random tiny Qwen3 with the built-in byte tokenizer, saved as a Hugging Face folder."""
    from rp_service.data.tokenizer import BYTE_VOCAB_SIZE, build_byte_tokenizer
    from tests.tiny_models import tiny_model

    folder = root / MODEL
    model = tiny_model(
        "qwen3",
        seed=None,
        vocab_size=BYTE_VOCAB_SIZE,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model.save_pretrained(folder)
    build_byte_tokenizer().save_pretrained(folder)


def _start(root: Path, **env: str) -> Daemon:
    daemon = Daemon(root / "data", {"RP_TOKEN": TOKEN, **env})
    daemon.start()
    return daemon


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    _tiny_model(root)
    return root


@pytest.fixture(scope="module")
def real_daemon(tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[Daemon]:
    daemon = _start(
        tmp_path_factory.mktemp("real"),
        RP_MODEL_ROOTS=str(model_root),
        RP_WORKER_MODULE="rp_service.worker",
        # Every checkpoint kept after the end (the default keeps the last), to page them.
        RP_KEEP_FINISHED_CHECKPOINTS="100",
    )
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def fake_daemon(tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[Daemon]:
    daemon = _start(tmp_path_factory.mktemp("fake"), RP_MODEL_ROOTS=str(model_root))
    yield daemon
    daemon.stop()


def _sdk(daemon: Daemon, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daemon.base_url}/v1", api_key=TOKEN, **kwargs)


def _wait(
    client: openai.OpenAI, job_id: str, until: Callable[[Any], bool], timeout_s: float = 60
) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        job = client.fine_tuning.jobs.retrieve(job_id)
        if until(job):
            return job
        assert time.monotonic() < deadline, f"job {job_id} stuck: {job}"
        time.sleep(0.05)


# ---------------------------------------------------------------- the real worker


@pytest.fixture(scope="module")
def trained(real_daemon: Daemon) -> dict[str, Any]:
    """One fine-tune through the SDK, polled to its end: 2 epochs of 20 examples, batch 4."""
    client = _sdk(real_daemon)
    train = client.files.create(
        file=("train.jsonl", _jsonl([_chat(i) for i in range(20)])), purpose="fine-tune"
    )
    valid = client.files.create(
        file=("valid.jsonl", _jsonl([_chat(i) for i in range(50, 53)])), purpose="fine-tune"
    )
    job = client.fine_tuning.jobs.create(
        model=MODEL,
        training_file=train.id,
        validation_file=valid.id,
        method={
            "type": "supervised",
            "supervised": {
                "hyperparameters": {
                    "n_epochs": 2,
                    "batch_size": 4,
                    "learning_rate_multiplier": 10,
                }
            },
        },
        suffix="adder",
        seed=1234,
        metadata={"team": "tests"},
    )
    done = _wait(client, job.id, lambda j: j.status in TERMINAL, timeout_s=300)
    return {"client": client, "train": train, "valid": valid, "created": job, "done": done}


def test_a_chat_file_fine_tunes_a_model_folder_to_succeeded(
    trained: dict[str, Any], real_daemon: Daemon
) -> None:
    client, train, created, done = (trained[k] for k in ("client", "train", "created", "done"))
    assert train.object == "file" and train.purpose == "fine-tune"
    assert train.status == "processed" and train.bytes == len(_jsonl([_chat(i) for i in range(20)]))
    assert client.files.retrieve(train.id).filename == "train.jsonl"
    assert client.files.content(train.id).read() == _jsonl([_chat(i) for i in range(20)])
    assert created.status in ("validating_files", "queued", "running")
    with real_daemon.client() as c:
        log = c.get(f"/v1/jobs/{done.id}/logs").text
    assert done.status == "succeeded", (done, log[-3000:])
    assert (done.model, done.suffix, done.seed) == (MODEL, "adder", 1234)
    assert done.metadata == {"team": "tests"} and done.validation_file == trained["valid"].id
    assert done.hyperparameters.model_dump() == {
        "n_epochs": 2,
        "batch_size": 4,
        "learning_rate_multiplier": 10.0,
    }
    assert done.method.type == "supervised"
    assert done.trained_tokens and done.trained_tokens > 0
    assert done.finished_at is not None and done.error is None
    assert done.fine_tuned_model == f"ft:{MODEL}:{done.id}"


def test_the_job_is_the_same_job_through_the_native_api(
    trained: dict[str, Any], real_daemon: Daemon
) -> None:
    done = trained["done"]
    with real_daemon.client() as c:
        native = c.get(f"/v1/jobs/{done.id}").json()
        listed = [j["id"] for j in c.get("/v1/jobs").json()["data"]]
    assert native["status"] == "succeeded" and done.id in listed
    assert (Path(native["output_model_path"]) / "config.json").is_file()
    assert native["trained_tokens"] == done.trained_tokens
    train = native["spec"]["train"]
    assert (train["epochs"], train["batch_size"], train["seed"]) == (2.0, 4, 1234)
    assert train["lr"] == pytest.approx(10 * 1e-5)
    assert native["spec"]["data"]["train"] == trained["train"].id
    assert native["spec"]["model"]["path"].endswith(MODEL)
    assert native["progress"]["step"] == 10  # 2 epochs x ceil(20 / 4)


def test_events_page_newest_first_with_after(trained: dict[str, Any], real_daemon: Daemon) -> None:
    client, done = trained["client"], trained["done"]
    with real_daemon.client() as c:
        native = c.get(f"/v1/jobs/{done.id}/events", params={"limit": 1000}).json()["data"]
    pages, after = [], None
    while True:
        kwargs = {"after": after} if after else {}
        page = client.fine_tuning.jobs.list_events(done.id, limit=4, **kwargs)
        pages.append(page.data)
        if not page.has_more:
            break
        after = page.data[-1].id
    assert all(len(p) == 4 for p in pages[:-1]) and len(pages) > 2
    got = [e for p in pages for e in p]
    assert [e.message for e in got] == [e["message"] for e in reversed(native)]
    assert [e.id for e in list(client.fine_tuning.jobs.list_events(done.id, limit=3))] == [
        e.id for e in got
    ]  # the SDK's own auto-paging follows the same cursor
    metrics = [e for e in got if e.type == "metrics"]
    assert [e.data["step"] for e in metrics] == list(range(10, 0, -1))
    assert got[0].message == "job succeeded" and got[0].object == "fine_tuning.job.event"


def test_checkpoints_are_listed_per_epoch(trained: dict[str, Any]) -> None:
    client, done = trained["client"], trained["done"]
    page = client.fine_tuning.jobs.checkpoints.list(done.id)
    assert [c.step_number for c in page.data] == [10, 5] and not page.has_more
    first = client.fine_tuning.jobs.checkpoints.list(done.id, limit=1)
    assert first.has_more and first.data[0].step_number == 10
    rest = client.fine_tuning.jobs.checkpoints.list(done.id, limit=1, after=first.data[0].id)
    assert [c.step_number for c in rest.data] == [5] and not rest.has_more
    for checkpoint in page.data:
        assert checkpoint.fine_tuning_job_id == done.id
        assert Path(checkpoint.fine_tuned_model_checkpoint).is_dir()
        assert checkpoint.metrics.train_loss is not None


def test_the_results_file_holds_the_loss_of_every_step(
    trained: dict[str, Any], real_daemon: Daemon
) -> None:
    client, done = trained["client"], trained["done"]
    (result_id,) = done.result_files
    info = client.files.retrieve(result_id)
    assert info.purpose == "fine-tune-results" and info.filename.endswith(".csv")
    content = client.files.content(result_id).read()
    assert len(content) == info.bytes
    rows = list(csv.DictReader(io.StringIO(content.decode())))
    with real_daemon.client() as c:
        events = c.get(f"/v1/jobs/{done.id}/events", params={"limit": 1000}).json()["data"]
    expected = [e["data"] for e in events if e["type"] == "metrics"]
    assert [int(r["step"]) for r in rows] == [m["step"] for m in expected]
    assert [float(r["train_loss"]) for r in rows] == [m["train_loss"] for m in expected]
    valid = {int(r["step"]): float(r["valid_loss"]) for r in rows if r["valid_loss"]}
    assert set(valid) == {5, 10}  # evaluated at each epoch's end
    assert valid == {m["step"]: m["valid_loss"] for m in expected if m["valid_loss"] is not None}
    listed = client.files.list(purpose="fine-tune-results")
    assert [f.id for f in listed.data] == [result_id]
    assert result_id not in [f.id for f in client.files.list().data]
    with pytest.raises(openai.BadRequestError):
        client.files.delete(result_id)


def test_refusals_come_as_the_sdks_exceptions(real_daemon: Daemon) -> None:
    client = _sdk(real_daemon, max_retries=0)
    bad = _jsonl([_chat(1), _chat(2)]) + b'{"messages": [{"role": "user", "content": "no"}]}\n'
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.files.create(file=("bad.jsonl", bad), purpose="fine-tune")
    assert "line 3" in info.value.message and info.value.body["details"] == {"line": 3}
    assert "assistant" in info.value.message
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("ok.jsonl", _jsonl([_chat(1)])), purpose="assistants")
    good = client.files.create(file=("ok.jsonl", _jsonl([_chat(1)])), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError) as info:
        client.fine_tuning.jobs.create(model="gpt-4o-mini", training_file=good.id)
    assert info.value.param == "model" and MODEL in info.value.message
    assert "qwen3, llama, qwen2, mistral, qwen3_moe, gpt_oss" in info.value.message  # every preset
    with pytest.raises(openai.BadRequestError) as info:
        client.fine_tuning.jobs.create(model=MODEL, training_file="file-missing")
    assert info.value.param == "training_file"
    refused = [
        ({"integrations": [{"type": "wandb", "wandb": {"project": "p"}}]}, "integrations"),
        # reinforcement needs its grader
        ({"method": {"type": "reinforcement"}}, "method.reinforcement"),
        # DPO trains on preference pairs: a chat file is refused naming it
        ({"method": {"type": "dpo", "dpo": {}}}, "training_file"),
        ({"extra_body": {"warmup_steps": 3}}, "warmup_steps"),
        ({"hyperparameters": {"n_epochs": 0}}, "hyperparameters.n_epochs"),
    ]
    for kwargs, param in refused:
        with pytest.raises(openai.BadRequestError) as info:
            client.fine_tuning.jobs.create(model=MODEL, training_file=good.id, **kwargs)
        assert info.value.param == param, info.value.body
    with pytest.raises(openai.NotFoundError):
        client.fine_tuning.jobs.retrieve("job-nope")
    with pytest.raises(openai.BadRequestError, match="unsupported query parameter"):
        client.fine_tuning.jobs.list(extra_query={"status": "running"})
    wrong = openai.OpenAI(base_url=f"{real_daemon.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.fine_tuning.jobs.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.files.list()
    # Nothing refused left a job behind: both APIs list the same jobs.
    assert [j.id for j in client.fine_tuning.jobs.list()] == _native_ids(real_daemon, "/v1/jobs")


def _pair(i: int) -> dict[str, Any]:
    """OpenAI's preference format: the right sum preferred over a wrong one."""
    return {
        "input": {"messages": [{"role": "user", "content": f"What is {i} plus {i}?"}]},
        "preferred_output": [{"role": "assistant", "content": f"{2 * i}."}],
        "non_preferred_output": [{"role": "assistant", "content": f"{2 * i + 1}."}],
    }


def test_a_dpo_method_runs_to_succeeded(real_daemon: Daemon) -> None:
    client = _sdk(real_daemon)
    bad = (
        _jsonl([_pair(1), _pair(2)])
        + json.dumps({**_pair(3), "non_preferred_output": _pair(3)["preferred_output"]}).encode()
        + b"\n"
    )
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.files.create(file=("bad.jsonl", bad), purpose="fine-tune")
    assert info.value.body["details"] == {"line": 3} and "identical" in info.value.message
    train = client.files.create(
        file=("pairs.jsonl", _jsonl([_pair(i) for i in range(8)])), purpose="fine-tune"
    )
    job = client.fine_tuning.jobs.create(
        model=MODEL,
        training_file=train.id,
        method={
            "type": "dpo",
            "dpo": {"hyperparameters": {"beta": 0.2, "n_epochs": 2, "batch_size": 4}},
        },
        seed=7,
    )
    assert job.method.type == "dpo" and job.method.dpo.hyperparameters.beta == 0.2
    done = _wait(client, job.id, lambda j: j.status in TERMINAL, timeout_s=300)
    with real_daemon.client() as c:
        log = c.get(f"/v1/jobs/{done.id}/logs").text
        native = c.get(f"/v1/jobs/{done.id}").json()
    assert done.status == "succeeded", (done, log[-3000:])
    assert native["spec"]["train"]["objective"] == "dpo" and native["spec"]["dpo"]["beta"] == 0.2
    assert done.fine_tuned_model == f"ft:{MODEL}:{done.id}"  # the chat model id, as for SFT
    assert (Path(native["output_model_path"]) / "config.json").is_file()
    events = list(client.fine_tuning.jobs.list_events(done.id, limit=100))
    metrics = [e.data for e in events if e.type == "metrics"]
    assert len(metrics) == 4  # 2 epochs of 8 pairs, 4 a step
    assert all("rewards/accuracies" in m and "logps/rejected" in m for m in metrics)


def test_a_reinforcement_job_raises_the_held_out_reward(real_daemon: Daemon) -> None:
    """OpenAI's reinforcement method with a string_check grader: GRPO on LoRA adapters
    teaches the tiny model to answer with a "y" (tests/integration/test_worker_grpo.py)."""
    from rp_service.data.tokenizer import BYTE_VOCAB_SIZE, build_byte_tokenizer
    from tests.integration.test_worker_grpo import GRADER, prompt_lines
    from tests.tiny_models import tiny_model

    # The demo model's shape (wider than MODEL): a few LoRA steps move its greedy answers.
    name = "tiny-qwen3-rl"
    folder = Path(real_daemon.env["RP_MODEL_ROOTS"]) / name
    tiny_model(
        "qwen3",
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=96,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    ).save_pretrained(folder)
    build_byte_tokenizer().save_pretrained(folder)
    client = _sdk(real_daemon)
    train = client.files.create(
        file=("prompts.jsonl", prompt_lines(64, seed=0).encode()), purpose="fine-tune"
    )
    valid = client.files.create(
        file=("held_out.jsonl", prompt_lines(16, seed=1).encode()), purpose="fine-tune"
    )
    with real_daemon.client() as c:
        assert c.get(f"/v1/files/{train.id}").json()["format"] == "prompt"
    job = client.fine_tuning.jobs.create(
        model=name,
        training_file=train.id,
        validation_file=valid.id,
        method={
            "type": "reinforcement",
            "reinforcement": {
                "grader": GRADER,
                "hyperparameters": {
                    "n_epochs": 2,
                    "batch_size": 8,
                    "learning_rate_multiplier": 10,
                    "eval_samples": 16,
                },
                # this daemon's extensions: LoRA adapters, short completions
                "lora": {"rank": 16},
                "grpo": {"max_completion_tokens": 12},
            },
        },
        seed=3,
    )
    assert job.method.type == "reinforcement"
    assert job.method.reinforcement.grader.type == "string_check"
    done = _wait(client, job.id, lambda j: j.status in TERMINAL, timeout_s=300)
    with real_daemon.client() as c:
        log = c.get(f"/v1/jobs/{done.id}/logs").text
        series = c.get(f"/v1/jobs/{done.id}/metrics").json()["columns"]
    assert done.status == "succeeded", (done, log[-3000:])
    events = list(client.fine_tuning.jobs.list_events(done.id, limit=100))
    metrics = sorted((e.data for e in events if e.type == "metrics"), key=lambda m: m["step"])
    assert [m["step"] for m in metrics] == list(range(1, 17))  # 2 epochs of 64 prompts, 8 a step
    assert metrics[0]["valid_reward_initial"] < 0.5
    assert metrics[-1]["valid_reward_mean"] >= 0.9, [m["reward_mean"] for m in metrics]
    assert series["reward_mean"] == [m["reward_mean"] for m in metrics]
    assert series["valid_reward_mean"][-1] == metrics[-1]["valid_reward_mean"]


# ---------------------------------------------------------------- the fake worker


def _chat_file(client: openai.OpenAI, n: int = 10) -> str:
    return client.files.create(
        file=("d.jsonl", _jsonl([_chat(i) for i in range(n)])), purpose="fine-tune"
    ).id


def test_cancel_pause_and_resume(fake_daemon: Daemon) -> None:
    """One CPU slot: `long` holds it while `queued` and `parked` wait behind it."""
    client = _sdk(fake_daemon)
    file_id = _chat_file(client)
    # The fake worker runs epochs x 10 steps of FAKE_STEP_S (0.05 s): 25 s for `long`.
    long = client.fine_tuning.jobs.create(
        model=MODEL, training_file=file_id, hyperparameters={"n_epochs": 50}
    )
    _wait(client, long.id, lambda j: j.status == "running")
    queued = client.fine_tuning.jobs.create(
        model=MODEL, training_file=file_id, hyperparameters={"n_epochs": 1}
    )
    assert queued.status == "queued"
    # The cancel's response is lost; the SDK's retry finds the job cancelled: no 409.
    lossy = _LoseFirstResponse(f"/v1/fine_tuning/jobs/{queued.id}/cancel")
    flaky = _sdk(fake_daemon, http_client=openai.DefaultHttpxClient(transport=lossy))
    cancelled = flaky.fine_tuning.jobs.cancel(queued.id)
    assert lossy.retry_headers == ["0", "1"]
    assert cancelled.status == "cancelled" and cancelled.finished_at is not None
    with pytest.raises(openai.ConflictError):
        client.fine_tuning.jobs.cancel(queued.id)  # a new request: the job has ended
    with pytest.raises(openai.ConflictError):
        client.fine_tuning.jobs.resume(queued.id)

    parked = client.fine_tuning.jobs.create(
        model=MODEL, training_file=file_id, hyperparameters={"n_epochs": 1}
    )
    assert client.fine_tuning.jobs.pause(parked.id).status == "paused"
    assert client.fine_tuning.jobs.resume(parked.id).status == "queued"

    fake_daemon.wait_for_step(long.id, 1)  # its worker is up and handles the pause signal
    client.fine_tuning.jobs.pause(long.id)  # checkpoints, then frees the slot for `parked`
    paused = _wait(client, long.id, lambda j: j.status == "paused")
    assert paused.finished_at is None
    newest = client.fine_tuning.jobs.checkpoints.list(long.id, limit=1).data[0]
    paused_step = fake_daemon.wait_for(long.id, {"paused"})["progress"]["step"]
    assert newest.step_number == paused_step  # the pause wrote a checkpoint of its step
    assert _wait(client, parked.id, lambda j: j.status in TERMINAL).status == "succeeded"

    assert client.fine_tuning.jobs.resume(long.id).status == "queued"
    fake_daemon.wait_for_step(long.id, paused_step + 1)  # on from its checkpoint
    client.fine_tuning.jobs.cancel(long.id)
    assert _wait(client, long.id, lambda j: j.status in TERMINAL).status == "cancelled"
    with fake_daemon.client() as c:
        messages = [e["message"] for e in c.get(f"/v1/jobs/{long.id}/events").json()["data"]]
    assert "job paused" in messages and "job cancelled" in messages


def test_a_native_job_is_seen_through_the_sdk(fake_daemon: Daemon) -> None:
    client = _sdk(fake_daemon)
    with fake_daemon.client() as c:
        native = c.post("/v1/jobs", json=spec(train={"steps": 3, "seed": 5})).json()
    job = _wait(client, native["id"], lambda j: j.status in TERMINAL)
    assert job.status == "succeeded" and job.model == "qwen3" and job.seed == 5
    assert job.training_file == "synthetic" and job.hyperparameters.batch_size == 8
    assert native["id"] in [j.id for j in client.fine_tuning.jobs.list(limit=100).data]


class _LoseFirstResponse(httpx2.BaseTransport):
    """Sends every request, but loses the response to the first POST to `path`: the
    server acts on it, the client sees a timeout and retries (what a flaky network does)."""

    def __init__(self, path: str) -> None:
        self.inner = httpx2.HTTPTransport()
        self.path = path
        self.lost = 0
        self.retry_headers: list[str | None] = []

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = self.inner.handle_request(request)
        if request.method == "POST" and request.url.path == self.path:
            self.retry_headers.append(request.headers.get("x-stainless-retry-count"))
            if not self.lost:
                self.lost += 1
                response.read()
                response.close()
                raise httpx2.ReadTimeout("response lost", request=request)
        return response


def _native_ids(daemon: Daemon, path: str) -> list[str]:
    with daemon.client() as c:
        return [item["id"] for item in c.get(path, params={"limit": 100}).json()["data"]]


@pytest.mark.parametrize("path", ["/v1/files", "/v1/fine_tuning/jobs"])
def test_a_retried_create_does_not_duplicate(fake_daemon: Daemon, path: str) -> None:
    setup = _sdk(fake_daemon)
    file_id = _chat_file(setup, n=7)
    native_path = "/v1/files" if path == "/v1/files" else "/v1/jobs"
    before = set(_native_ids(fake_daemon, native_path))
    transport = _LoseFirstResponse(path)
    client = _sdk(fake_daemon, http_client=openai.DefaultHttpxClient(transport=transport))
    content = _jsonl([_chat(i) for i in range(3)])
    if path == "/v1/files":
        made = client.files.create(file=("r.jsonl", content), purpose="fine-tune")
    else:
        made = client.fine_tuning.jobs.create(model=MODEL, training_file=file_id, suffix="retry")
    assert transport.retry_headers == ["0", "1"]  # the SDK retried once, and said so
    created = set(_native_ids(fake_daemon, native_path)) - before
    assert created == {made.id}
    # A second call is a new request (retry count 0): it does create again.
    if path == "/v1/files":
        again = setup.files.create(file=("r.jsonl", content), purpose="fine-tune")
    else:
        again = setup.fine_tuning.jobs.create(model=MODEL, training_file=file_id, suffix="retry")
    assert again.id != made.id


def test_jobs_are_filtered_by_metadata(fake_daemon: Daemon) -> None:
    client = _sdk(fake_daemon)
    file_id = _chat_file(client, n=3)
    tag = f"run-{time.monotonic_ns()}"
    made = [
        client.fine_tuning.jobs.create(
            model=MODEL, training_file=file_id, metadata={"tag": tag, "i": str(i)}
        ).id
        for i in range(3)
    ]
    assert [j.id for j in client.fine_tuning.jobs.list(metadata={"tag": tag})] == made[::-1]
    page = client.fine_tuning.jobs.list(metadata={"tag": tag}, limit=2)
    assert [j.id for j in page.data] == [made[2], made[1]] and page.has_more
    only = client.fine_tuning.jobs.list(metadata={"tag": tag, "i": "1"})
    assert [j.id for j in only.data] == [made[1]]
    assert client.fine_tuning.jobs.list(metadata={"tag": "none"}).data == []
    plain = client.fine_tuning.jobs.create(model=MODEL, training_file=file_id).id
    untagged = {j.id for j in client.fine_tuning.jobs.list(extra_query={"metadata": "null"})}
    assert plain in untagged and not untagged & set(made)


def test_an_idempotency_key_returns_the_same_job(fake_daemon: Daemon) -> None:
    client = _sdk(fake_daemon, max_retries=0)
    file_id = _chat_file(client, n=5)
    key = {"Idempotency-Key": f"key-{time.monotonic_ns()}"}
    first = client.fine_tuning.jobs.create(model=MODEL, training_file=file_id, extra_headers=key)
    again = client.fine_tuning.jobs.create(model=MODEL, training_file=file_id, extra_headers=key)
    assert again.id == first.id and again.seed == first.seed
    with pytest.raises(openai.ConflictError) as info:
        client.fine_tuning.jobs.create(
            model=MODEL, training_file=file_id, suffix="other", extra_headers=key
        )
    assert info.value.response.headers["x-should-retry"] == "false"
    # with a seed given, metadata alone differs (the OpenAI object's, not the native spec's):
    # still another body
    key = {"Idempotency-Key": f"seeded-{time.monotonic_ns()}"}
    made = dict(model=MODEL, training_file=file_id, seed=7, extra_headers=key)
    first = client.fine_tuning.jobs.create(**made, metadata={"run": "a"})  # type: ignore[arg-type]
    with pytest.raises(openai.ConflictError) as info:
        client.fine_tuning.jobs.create(**made, metadata={"run": "b"})  # type: ignore[arg-type]
    assert info.value.body["code"] == "idempotency_key_reused"  # type: ignore[index]
    again = client.fine_tuning.jobs.create(**made, metadata={"run": "a"})  # type: ignore[arg-type]
    assert again.id == first.id


def test_a_supervised_lora_method_makes_a_lora_job(fake_daemon: Daemon) -> None:
    """The SDK passes this daemon's `method.supervised.lora` through; the native job trains
    adapters (`train.method: lora`) at the LoRA learning rate."""
    client = _sdk(fake_daemon)
    lora = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    job = client.fine_tuning.jobs.create(
        model=MODEL,
        training_file=_chat_file(client),
        method={"type": "supervised", "supervised": {"lora": lora}},  # type: ignore[typeddict-unknown-key]
    )
    with fake_daemon.client() as c:
        spec = c.get(f"/v1/jobs/{job.id}").json()["spec"]
    assert spec["train"]["method"] == "lora"
    assert {k: spec["lora"][k] for k in lora} == {**lora, "alpha": 8.0}
    assert spec["train"]["lr"] == pytest.approx(1e-4)
    with pytest.raises(openai.BadRequestError) as refused:
        client.fine_tuning.jobs.create(
            model=MODEL,
            training_file=job.training_file,
            method={"type": "supervised", "supervised": {"lora": {"rank": 0}}},  # type: ignore[typeddict-unknown-key]
        )
    assert refused.value.body["param"] == "method.supervised.lora.rank"  # type: ignore[index]
