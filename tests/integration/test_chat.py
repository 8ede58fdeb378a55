"""Chat with trained models: the official `openai` SDK against a real daemon with the real
worker and the real serving process, on the CPU. The oracles are transformers' greedy
`generate` and peft's, run here on the saved outputs with the same chat template."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.service_daemon import Daemon
from tests.integration.test_openai_api import MODEL, _chat, _jsonl, _tiny_model

TOKEN = "chat-test-token"
NO_TEMPLATE = "plain-qwen3"
HASH_TEMPLATE = "hash-qwen3"
HASH = (
    "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:\n{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 3 plus 3?"},
]
MAX_TOKENS = 24
TERMINAL = {"succeeded", "failed", "cancelled"}


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-qwen3 (the byte tokenizer, its ChatML template), a copy without a template and
    one whose template is `### role:` lines."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("models")
    _tiny_model(root)
    for name, template in ((NO_TEMPLATE, None), (HASH_TEMPLATE, HASH)):
        copy = root / name
        copy.mkdir()
        for file in ("config.json", "model.safetensors"):
            (copy / file).write_bytes((root / MODEL / file).read_bytes())
        tokenizer = AutoTokenizer.from_pretrained(root / MODEL)
        tokenizer.chat_template = template
        tokenizer.save_pretrained(copy)
    return root


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[Daemon]:
    daemon = Daemon(
        tmp_path_factory.mktemp("chat") / "data",
        {
            "RP_TOKEN": TOKEN,
            "RP_MODEL_ROOTS": str(model_root),
            "RP_WORKER_MODULE": "rp_service.worker",
        },
    )
    daemon.start()
    yield daemon
    daemon.stop()


def _sdk(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daemon.base_url}/v1", api_key=TOKEN, max_retries=0)


def _wait(client: openai.OpenAI, job_id: str, timeout_s: float = 300) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        job = client.fine_tuning.jobs.retrieve(job_id)
        if job.status in TERMINAL:
            return job
        assert time.monotonic() < deadline, f"job {job_id} stuck: {job}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def demo_job(daemon: Daemon) -> Any:
    """The demo model (a qwen3 preset, the byte tokenizer), trained briefly through the
    native API; its OpenAI face carries the model id."""
    with daemon.client() as c:
        spec = c.get("/v1/demo").json()
        spec["train"].update(steps=12, eval_interval=0, checkpoint_interval=0)
        spec["data"]["valid"] = None
        job_id = c.post("/v1/jobs", json=spec).json()["id"]
    job = _wait(_sdk(daemon), job_id)
    assert job.status == "succeeded", daemon.log_path.read_text()[-3000:]
    return job


@pytest.fixture(scope="module")
def lora_job(daemon: Daemon) -> Any:
    """LoRA adapters on the tiny-qwen3 folder, through the OpenAI fine-tuning API."""
    client = _sdk(daemon)
    train = client.files.create(
        file=("train.jsonl", _jsonl([_chat(i) for i in range(12)])), purpose="fine-tune"
    )
    job = client.fine_tuning.jobs.create(
        model=MODEL,
        training_file=train.id,
        method={
            "type": "supervised",
            "supervised": {
                "hyperparameters": {"n_epochs": 3, "batch_size": 4, "learning_rate_multiplier": 10},
                "lora": {"rank": 4, "alpha": 64},
            },
        },  # type: ignore[typeddict-unknown-key]
        seed=7,
    )
    done = _wait(client, job.id)
    assert done.status == "succeeded", daemon.log_path.read_text()[-3000:]
    return done


def _output(daemon: Daemon, job_id: str) -> Path:
    with daemon.client() as c:
        return Path(c.get(f"/v1/jobs/{job_id}").json()["output_model_path"])


def _greedy(model: Any, tokenizer_dir: Path, messages: list[dict[str, str]]) -> tuple[str, int]:
    """transformers' greedy answer: the text (special tokens dropped) and its token count."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    stop = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            eos_token_id=stop,
            pad_token_id=tokenizer.pad_token_id,
            use_cache=True,
        )
    new = out[0, len(prompt) :].tolist()
    return tokenizer.decode(new, skip_special_tokens=True), len(new)


def _hf_model(folder: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _ask(client: openai.OpenAI, model: str, **kwargs: Any) -> Any:
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, **kwargs)


def test_a_trained_demo_model_answers_as_greedy_generate(demo_job: Any, daemon: Daemon) -> None:
    client = _sdk(daemon)
    assert demo_job.fine_tuned_model == f"ft:qwen3:{demo_job.id}"
    got = _ask(client, demo_job.fine_tuned_model)
    output = _output(daemon, demo_job.id)
    expected, tokens = _greedy(_hf_model(output), output, MESSAGES)
    assert got.object == "chat.completion" and got.model == demo_job.fine_tuned_model
    assert got.choices[0].message.content == expected
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].finish_reason == ("length" if tokens == MAX_TOKENS else "stop")
    assert got.usage is not None and got.usage.completion_tokens == tokens
    assert got.usage.total_tokens == got.usage.prompt_tokens + tokens
    # The bare job id names the same model (what `rp chat JOB` sends).
    again = _ask(client, demo_job.id)
    assert (again.model, again.choices[0].message.content) == (got.model, expected)

    streamed = list(_ask(client, demo_job.fine_tuned_model, stream=True))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected
    assert [c.choices[0].finish_reason for c in streamed][-1] == got.choices[0].finish_reason
    assert all(c.id == streamed[0].id and c.object == "chat.completion.chunk" for c in streamed)
    with_usage = list(
        _ask(client, demo_job.fine_tuned_model, stream=True, stream_options={"include_usage": True})
    )
    assert with_usage[-1].choices == [] and with_usage[-1].usage == got.usage
    assert all(c.usage is None for c in with_usage[:-1])


def test_the_stream_is_server_sent_events_ending_in_done(demo_job: Any, daemon: Daemon) -> None:
    body = {
        "model": demo_job.fine_tuned_model,
        "messages": MESSAGES,
        "temperature": 0,
        "max_completion_tokens": 5,
        "stream": True,
    }
    with daemon.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all("usage" not in chunk for chunk in chunks)


def test_a_stop_sequence_cuts_the_answer(demo_job: Any, daemon: Daemon) -> None:
    client = _sdk(daemon)
    full = _ask(client, demo_job.fine_tuned_model).choices[0].message.content
    assert len(full) >= 3, full
    stop = full[2]
    got = _ask(client, demo_job.fine_tuned_model, stop=[stop])
    assert got.choices[0].message.content == full[: full.index(stop)]
    assert got.choices[0].finish_reason == "stop"
    streamed = _ask(client, demo_job.fine_tuned_model, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == full[: full.index(stop)]


def test_a_lora_adapter_is_served_on_its_base(
    lora_job: Any, daemon: Daemon, model_root: Path
) -> None:
    from peft import PeftModel

    client = _sdk(daemon)
    assert lora_job.fine_tuned_model == f"ft:{MODEL}:{lora_job.id}"
    adapter = _output(daemon, lora_job.id)
    assert (adapter / "adapter_config.json").is_file()
    tuned = _ask(client, lora_job.fine_tuned_model)
    base = _ask(client, MODEL)  # the same process, adapters disabled
    peft_model = PeftModel.from_pretrained(_hf_model(model_root / MODEL), adapter).eval()
    expected, tokens = _greedy(peft_model, adapter, MESSAGES)
    base_expected, _ = _greedy(_hf_model(model_root / MODEL), model_root / MODEL, MESSAGES)
    assert tuned.choices[0].message.content == expected
    assert tuned.usage is not None and tuned.usage.completion_tokens == tokens
    assert base.choices[0].message.content == base_expected
    assert expected != base_expected  # the adapter changed the answer: it was applied
    # Both ids are served by one process holding the base once.
    serving = {client.models.retrieve(m).serving["pid"] for m in (MODEL, lora_job.fine_tuned_model)}  # type: ignore[attr-defined, index]
    assert len(serving) == 1


def test_models_list_and_retrieve(demo_job: Any, lora_job: Any, daemon: Daemon) -> None:
    client = _sdk(daemon)
    listed = {m.id: m for m in client.models.list()}
    assert {"qwen3", "llama", MODEL, NO_TEMPLATE} <= set(listed)
    assert {demo_job.fine_tuned_model, lora_job.fine_tuned_model} <= set(listed)
    assert all(m.object == "model" for m in listed.values())
    assert listed[demo_job.fine_tuned_model].owned_by == "org-roundpipe"
    one = client.models.retrieve(lora_job.fine_tuned_model)
    assert one.id == lora_job.fine_tuned_model and one.created == lora_job.finished_at
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("ft:qwen3:job-000000000000000000000000")


def test_refusals_are_the_sdks_exceptions(demo_job: Any, daemon: Daemon) -> None:
    client = _sdk(daemon)
    with pytest.raises(openai.NotFoundError) as unknown:
        _ask(client, "no-such-model")
    assert unknown.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        _ask(client, f"ft:llama:{demo_job.id}")  # the job's id under another base
    with pytest.raises(openai.BadRequestError) as plain:
        _ask(client, NO_TEMPLATE)
    assert "chat template" in str(plain.value)
    assert plain.value.body["code"] == "no_chat_template"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as preset:
        _ask(client, "qwen3")
    assert "preset" in str(preset.value)
    with pytest.raises(openai.BadRequestError) as penalty:
        _ask(client, demo_job.fine_tuned_model, frequency_penalty=0.5)
    assert penalty.value.body["param"] == "frequency_penalty"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as two:
        _ask(client, demo_job.fine_tuned_model, n=2)
    assert two.value.body["param"] == "n"  # type: ignore[index]


def test_an_idle_model_process_stops(tmp_path: Path, model_root: Path) -> None:
    daemon = Daemon(
        tmp_path / "data",
        {"RP_TOKEN": TOKEN, "RP_MODEL_ROOTS": str(model_root), "RP_SERVE_IDLE_S": "1"},
    )
    daemon.start()
    try:
        client = _sdk(daemon)
        _ask(client, MODEL, max_tokens=2)
        serving = client.models.retrieve(MODEL).serving  # type: ignore[attr-defined]
        assert serving is not None and serving["device"] == "cpu"
        pid = serving["pid"]
        os.kill(pid, 0)  # alive
        deadline = time.monotonic() + 30
        while client.models.retrieve(MODEL).serving is not None:  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, "the idle process was not stopped"
            time.sleep(0.2)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        # The next request starts a new process.
        assert _ask(client, MODEL, max_tokens=2).choices[0].finish_reason in ("stop", "length")
    finally:
        daemon.stop()


def test_the_rp_sdk_and_rp_chat_give_the_same_answer(demo_job: Any, daemon: Daemon) -> None:
    from typer.testing import CliRunner

    from tests.integration.client_fixtures import AsyncClient, Client

    expected = _ask(_sdk(daemon), demo_job.id).choices[0].message.content
    with Client(daemon.base_url, token=TOKEN) as client:
        reply = client.chat(demo_job.id, MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
        pieces = list(
            client.chat.stream(demo_job.id, MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
        )
        assert (reply.content, "".join(pieces)) == (expected, expected)
        assert reply.model == demo_job.fine_tuned_model

        from rp_client.cli import app

        args = ["chat", demo_job.id, "--system", MESSAGES[0]["content"], "-t", "0"]
        args += ["--max-tokens", str(MAX_TOKENS), "--prompt", MESSAGES[1]["content"]]
        result = CliRunner().invoke(app, args, obj={"client": client})
    assert result.exit_code == 0, result.output
    assert result.stdout == expected + "\n"

    async def ask_async() -> str:
        async with AsyncClient(daemon.base_url, token=TOKEN) as client:
            return (
                await client.chat(demo_job.id, MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
            ).content

    import asyncio

    assert asyncio.run(ask_async()) == expected


def test_a_folders_own_template_trains_and_serves_the_same(
    daemon: Daemon, model_root: Path
) -> None:
    """A `### role:` template: trained on its rendering, the model answers its own
    template's prompt with the reply it learned (ChatML training would not have taught it)."""
    question = [{"role": "user", "content": "3 plus 4?"}]
    record = {"messages": [*question, {"role": "assistant", "content": "7 it is."}]}
    with daemon.client() as c:
        upload = c.post("/v1/files", files={"file": ("hash.jsonl", _jsonl([record] * 4))})
        spec = {
            "model": {"path": str(model_root / HASH_TEMPLATE)},
            "data": {"train": upload.json()["id"], "seq_len": 48, "packing": False},
            "engine": {"async_step": False},
            "train": {"steps": 60, "batch_size": 2, "lr": 1e-2, "warmup_steps": 0,
                      "schedule": "constant", "grad_clip": None,
                      "eval_interval": 0, "checkpoint_interval": 0},
        }  # fmt: skip
        job_id = c.post("/v1/jobs", json=spec).json()["id"]
        # The same data for the folder without a template: refused at submission.
        spec["model"]["path"] = str(model_root / NO_TEMPLATE)  # type: ignore[index]
        refused = c.post("/v1/jobs", json=spec)
        assert refused.status_code == 422, refused.text
        assert refused.json()["error"]["param"] == "data.train"
        assert "tokenizer.chat_template" in refused.json()["error"]["message"]
    job = _wait(_sdk(daemon), job_id)
    assert job.status == "succeeded", daemon.log_path.read_text()[-3000:]
    output = _output(daemon, job_id)
    assert (output / "chat_template.jinja").read_text() == HASH
    got = _sdk(daemon).chat.completions.create(
        model=job_id, messages=question, temperature=0, max_tokens=MAX_TOKENS
    )
    assert got.choices[0].message.content == "7 it is.\n"  # its turns end with a newline
    assert got.choices[0].finish_reason == "stop"


def test_a_lora_job_exports_to_gguf_through_the_sdk(lora_job: Any, daemon: Daemon) -> None:
    """`jobs.export`: the adapter merged into its base, written as GGUF with a Modelfile,
    through the daemon's export process (the GGUF itself is checked in depth by
    tests/unit/rp_service/test_gguf_export.py and the slow llama.cpp test)."""
    import gguf
    from rp_client import Client
    from rp_client.errors import Conflict

    with Client(base_url=daemon.base_url, token=TOKEN) as client:
        done = client.jobs.export(lora_job.id, type="f32")
        assert done.path.endswith(f"{lora_job.id}-f32.gguf") and done.size_bytes > 0
        assert Path(done.modelfile).read_text().startswith(f"FROM ./{lora_job.id}-f32.gguf")
        reader = gguf.GGUFReader(done.path)
        assert reader.fields["general.architecture"].contents() == "qwen3"
        assert "<|im_start|>" in reader.fields["tokenizer.chat_template"].contents()
        with daemon.client() as c:
            spec = c.get("/v1/demo").json()
        running = client.jobs.create(spec)
        with pytest.raises(Conflict):
            client.jobs.export(running.id)
        client.jobs.cancel(running.id)
