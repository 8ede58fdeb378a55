"""Chat serving without a model: ids, the request schema, stop sequences, GPU accounting
(the 503 while jobs hold every GPU) and its rendering by the app."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from rp_service.app import create_app
from rp_service.jobs.store import JobRecord
from rp_service.openai.chat_schemas import ChatCompletionCreate
from rp_service.serving.manager import ServingBusy, ServingManager, ServingProcess
from rp_service.serving.models import BaseModel, base_name, fine_tuned_id, job_id_of, preset_names
from rp_service.serving.process import Server
from rp_service.settings import Settings


def _job(status: str = "succeeded", **spec: Any) -> JobRecord:
    return JobRecord(
        id="job-abc",
        status=status,
        created_at=1,
        spec={"model": spec or {"preset": "qwen3"}},
        output_model_path="/out" if status == "succeeded" else None,
    )


def test_model_ids_name_the_job_after_the_last_colon() -> None:
    assert fine_tuned_id(_job()) == "ft:qwen3:job-abc"
    assert fine_tuned_id(_job(path="/models/Qwen/Qwen3-0.6B")) == "ft:Qwen3-0.6B:job-abc"
    assert fine_tuned_id(_job("running")) is None
    assert base_name(_job(path="/models/a")) == "a"
    assert {"qwen3", "llama", "qwen2"} <= set(preset_names())
    assert job_id_of("ft:org/Qwen3-8B:job-abc") == "job-abc"
    assert job_id_of("job-abc") == "job-abc"
    assert job_id_of("ft:qwen3:nothing") is None and job_id_of("Qwen3-8B") is None


def test_base_keys_are_equal_for_equal_weights() -> None:
    a = BaseModel(preset="qwen3", config={"hidden_size": 32}, seed=1, tokenizer="/t")
    assert a.key == BaseModel.from_json(a.to_json()).key
    assert (
        a.key != BaseModel(preset="qwen3", config={"hidden_size": 32}, seed=2, tokenizer="/t").key
    )
    assert BaseModel(path="/m").key != BaseModel(path="/n").key


def test_the_request_refuses_what_it_cannot_do() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    body = ChatCompletionCreate(model="m", messages=messages, max_tokens=5, top_p=0)
    assert body.generation()["messages"] == [{"role": "user", "content": "ab"}]
    assert body.generation()["temperature"] == 0.0  # top_p 0 leaves one token: greedy
    both = ChatCompletionCreate(model="m", messages=messages, max_tokens=5, max_completion_tokens=7)
    assert both.generation()["max_tokens"] == 7
    for bad in ({"n": 2}, {"stop": ["a"] * 5}, {"tools": []}, {"temperature": 2.5}):
        with pytest.raises(ValidationError):
            ChatCompletionCreate(model="m", messages=messages, **bad)
    with pytest.raises(ValidationError):
        ChatCompletionCreate(model="m", messages=[{"role": "tool", "content": "x"}])


class _Out:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, **message: Any) -> None:
        self.sent.append(message)


def _relay(pieces: list[str], stops: list[str]) -> tuple[list[str], bool]:
    import threading

    server = Server.__new__(Server)  # _relay needs only `out`
    server.out = _Out()  # type: ignore[assignment]
    matched = server._relay("r", iter(pieces), stops, threading.Event())
    return [m["text"] for m in server.out.sent], matched  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("pieces", "stops", "sent", "matched"),
    [
        (["Hello ", "world"], [], ["Hello ", "world"], False),
        (["Hello ", "wor", "ld!"], ["o w"], ["Hell"], True),
        # "wo" could start the stop "wor": held back, then sent once it cannot.
        (["Hello wo", "w!"], ["wor"], ["Hello ", "wow!"], False),
        (["ab", "c"], ["x", "bc"], ["a"], True),
        (["abc"], ["abc"], [], True),
        (["one", " two"], ["three"], ["one", " two"], False),
    ],
)
def test_stop_sequences_are_cut_and_never_sent(
    pieces: list[str], stops: list[str], sent: list[str], matched: bool
) -> None:
    assert _relay(pieces, stops) == (sent, matched)


class _Pool:
    """The orchestrator's GPU accounting: `held` GPUs run jobs."""

    def __init__(self, gpus: list[int], held: dict[int, str]) -> None:
        self.gpu_ids = gpus
        self.held = held
        self.lent: list[int] = []
        self.gpus_wanted: Any = None

    def lend_gpu(self) -> int | None:
        free = [g for g in self.gpu_ids if g not in self.held and g not in self.lent]
        if free:
            self.lent.append(free[0])
            return free[0]
        return None

    def return_gpu(self, gpu: int) -> None:
        self.lent.remove(gpu)

    def gpu_jobs(self) -> dict[int, str]:
        return dict(self.held)

    def worker_host_bytes(self) -> dict[str, int]:
        return {}


class _Proc:
    pid = 4242
    returncode: int | None = None
    stdin = None

    async def wait(self) -> int:
        self.returncode = 0
        return 0


def test_no_free_gpu_is_a_503_naming_the_jobs(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, serve_idle_s=30)
    manager = ServingManager(settings, _Pool([0, 1], {0: "job-a", 1: "job-b"}))
    with pytest.raises(ServingBusy) as busy:
        asyncio.run(manager._device())
    assert "job-a" in busy.value.message and "job-b" in busy.value.message
    assert busy.value.status_code == 503 and busy.value.retry_after_s == 30


def test_an_idle_served_model_gives_its_gpu_to_the_next(tmp_path: Path) -> None:
    pool = _Pool([0], {})
    manager = ServingManager(Settings(data_dir=tmp_path), pool)

    async def scenario() -> tuple[int | None, list[int]]:
        first = await manager._device()
        assert first == 0 and pool.lent == [0]
        old = ServingProcess(base=BaseModel(path="/a"), gpu=0, proc=_Proc(), loaded=True)  # type: ignore[arg-type]
        manager.processes[old.base.key] = old
        old.in_flight = 1  # generating: never stopped for another model
        with pytest.raises(ServingBusy):
            await manager._device()
        old.in_flight = 0
        gpu = await manager._device()
        return gpu, list(manager.processes)

    gpu, left = asyncio.run(scenario())
    assert gpu == 0 and pool.lent == [0] and left == []


def test_without_gpus_the_cpu_serves(tmp_path: Path) -> None:
    manager = ServingManager(Settings(data_dir=tmp_path), _Pool([], {}))
    assert asyncio.run(manager._device()) is None


def test_the_503_carries_retry_after(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rp_service.openai.chat import Chat

    async def busy(self: Chat, body: Any, **kwargs: Any) -> Any:
        raise ServingBusy("every GPU is in use (GPU 0: job job-a)", retry_after_s=7)

    monkeypatch.setattr(Chat, "open", busy)
    settings = Settings(data_dir=tmp_path, gpus="none", token="tok")
    app = create_app(settings)
    headers = {"Authorization": "Bearer tok"}
    with TestClient(app, base_url="http://127.0.0.1", headers=headers) as client:
        r = client.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert r.status_code == 503 and r.headers["retry-after"] == "7"
    assert r.json()["error"]["code"] == "gpus_busy" and "job-a" in r.json()["error"]["message"]


def _lora_folders(tmp_path: Path) -> tuple[Path, list[Path]]:
    """A tiny model folder and two random peft adapters on it (B != 0)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from tests.tiny_models import tiny_model

    model = tiny_model("qwen3", seed=3, vocab_size=64, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)  # fmt: skip
    model.save_pretrained(tmp_path / "base")
    adapters = []
    for k in range(2):
        torch.manual_seed(10 + k)
        peft = get_peft_model(
            tiny_model("qwen3", seed=3, vocab_size=64, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, tie_word_embeddings=False),
            LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
        )  # fmt: skip
        with torch.no_grad():
            for name, param in peft.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.1)
        peft.save_pretrained(tmp_path / f"adapter{k}")
        adapters.append(tmp_path / f"adapter{k}")
    return tmp_path / "base", adapters


def test_folded_adapters_match_peft_and_give_the_base_back_exactly(tmp_path: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir, adapters = _lora_folders(tmp_path)
    server = Server(BaseModel(path=str(base_dir)), device="cpu", out=_Out(), fold_adapters=True)
    ids = torch.tensor([[1, 5, 9, 33, 2, 17, 40]])

    def logits(adapter: Path | None) -> torch.Tensor:
        model, context = server._select(None if adapter is None else str(adapter))
        with torch.inference_mode(), context:
            return model(input_ids=ids).logits

    weights = {n: p for n, p in server.base.named_parameters()}
    plain = logits(None)
    first = [logits(a) for a in adapters]
    for adapter, got in zip(adapters, first, strict=True):
        reference = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        expected = PeftModel.from_pretrained(reference, adapter).eval()(input_ids=ids).logits
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(got, plain)  # the adapter changes the answer
    again = [logits(adapters[1]), logits(adapters[0]), logits(None)]
    assert torch.equal(again[0], first[1]) and torch.equal(again[1], first[0])
    assert torch.equal(again[2], plain)  # no drift: the base weights are put back as they were
    for name, param in server.base.named_parameters():
        if "lora_" not in name:
            assert param is weights[name.replace(".base_layer", "")], name


def test_a_dead_process_gives_its_gpu_back_before_a_new_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = _Pool([0], {})
    manager = ServingManager(Settings(data_dir=tmp_path), pool)
    base = BaseModel(path="/a")

    async def spawn(process: ServingProcess) -> None:
        process.proc = _Proc()  # type: ignore[assignment]
        process.loaded = True

    monkeypatch.setattr(manager, "_spawn", spawn)

    async def scenario() -> list[int | None]:
        first = await manager._process(base)
        first.proc.returncode = -9  # type: ignore[union-attr]  (killed, e.g. out of memory)
        second = await manager._process(base)
        assert second is not first and manager.processes == {base.key: second}
        await manager.stop()
        return [first.gpu, second.gpu]

    assert asyncio.run(scenario()) == [None, None] and pool.lent == []


def test_a_queued_job_takes_the_gpu_of_an_idle_served_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = _Pool([0], {})
    manager = ServingManager(Settings(data_dir=tmp_path), pool)

    async def spawn(process: ServingProcess) -> None:
        process.proc = _Proc()  # type: ignore[assignment]
        process.loaded = True

    monkeypatch.setattr(manager, "_spawn", spawn)

    async def scenario() -> tuple[list[int], list[int]]:
        process = await manager._process(BaseModel(path="/a"))
        process.in_flight = 1
        assert pool.gpus_wanted is not None
        pool.gpus_wanted()  # what the orchestrator calls while a job waits for GPUs
        await asyncio.sleep(0.05)
        generating = list(pool.lent)  # an answer being written keeps its GPU
        process.in_flight = 0
        pool.gpus_wanted()
        for _ in range(100):
            if not pool.lent:
                break
            await asyncio.sleep(0.01)
        await manager.stop()
        return generating, list(pool.lent)

    assert asyncio.run(scenario()) == ([0], [])
    assert manager.processes == {}


def test_the_static_cache_comes_in_few_sizes() -> None:
    from rp_service.serving.process import static_cache_tokens

    assert static_cache_tokens(23 + 128, 40960) == 2048  # a short chat: the smallest size
    assert static_cache_tokens(2049, 40960) == 4096
    assert static_cache_tokens(5000, 40960) == 8192
    assert static_cache_tokens(30000, 40960) == 32768
    assert static_cache_tokens(35000, 40960) == 40960  # never past the model's positions
    assert static_cache_tokens(19, 64) == 64


def test_a_state_is_answered_eagerly_then_warmed_up_for_the_static_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compile bookkeeping on the CPU (where transformers does not compile, so the
    static cache runs eagerly): the first answer for a state uses the dynamic cache, the
    warm-up then marks the state, and later answers use the static cache; the answers are
    the same tokens."""
    from rp_service.serving import process
    from tests.gpu.test_serving_gpu import _folders  # a word tokenizer with a chat template

    base_dir, _ = _folders(tmp_path)
    monkeypatch.setattr(process, "_compile_decoding", lambda device: True)
    caches: list[str | None] = []
    out = _Out()
    server = Server(BaseModel(path=str(base_dir)), device="cpu", out=out)
    original = server.base.generate

    def spy(*args: Any, **kwargs: Any) -> Any:
        caches.append(kwargs.get("cache_implementation"))
        return original(*args, **kwargs)

    monkeypatch.setattr(server.base, "generate", spy)
    request = {"messages": [{"role": "user", "content": "hi"}], "tokenizer": str(base_dir),
               "adapter": None, "max_tokens": 6, "temperature": 0.0, "top_p": None,
               "seed": None, "stop": []}  # fmt: skip
    server.answer({**request, "id": "r0"})
    server.answer({**request, "id": "r1"})
    # answer r0 (dynamic), the warm-up (static), answer r1 (static); no second warm-up
    assert caches == [None, "static", "static"]
    assert server.compiled == {None: True}
    texts = ["".join(m["text"] for m in out.sent if m.get("id") == r and m["type"] == "delta")
             for r in ("r0", "r1")]  # fmt: skip
    assert texts[0] == texts[1] and texts[0]


def test_a_failing_compiled_step_falls_back_to_eager_decoding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rp_service.serving import process
    from tests.gpu.test_serving_gpu import _folders

    base_dir, _ = _folders(tmp_path)
    monkeypatch.setattr(process, "_compile_decoding", lambda device: True)
    out = _Out()
    server = Server(BaseModel(path=str(base_dir)), device="cpu", out=out)
    original = server.base.generate

    def static_fails(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("cache_implementation") == "static" and kwargs.get("max_new_tokens") != 2:
            raise RuntimeError("a compiled graph failed")
        return original(*args, **kwargs)

    monkeypatch.setattr(server.base, "generate", static_fails)
    request = {"messages": [{"role": "user", "content": "hi"}], "tokenizer": str(base_dir),
               "adapter": None, "max_tokens": 4, "temperature": 0.0, "top_p": None,
               "seed": None, "stop": []}  # fmt: skip
    for k in range(3):
        server.answer({**request, "id": f"r{k}"})
    kinds = [(m["id"], m["type"]) for m in out.sent if m["type"] in ("done", "error")]
    assert kinds == [("r0", "done"), ("r1", "error"), ("r2", "done")]
    assert server.compiled == {None: False}
