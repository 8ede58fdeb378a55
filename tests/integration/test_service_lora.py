"""LoRA jobs: the worker's pause/resume and checkpoints, and a job through a real daemon.

The worker tests run `python -m rp_service.worker` as test_worker.py does; the daemon test
fine-tunes a local model directory with LoRA and loads the adapter back with peft.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.service_daemon import Daemon
from tests.integration.test_worker import EXIT_PAUSED, make_job, metrics, run

# Big enough MLPs that the base dwarfs a rank-2 adapter; small enough for seconds a run.
MODEL_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 64,
}
LORA = {"rank": 2, "alpha": 4.0, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]}
STEPS = 16
SMALL_LORA = {
    "model.config": MODEL_CONFIG,
    "data.seq_len": 32,
    "train.batch_size": 4,
    "train.steps": STEPS,
    "train.lr": 1e-2,
    "train.warmup_steps": 2,
    "train.eval_interval": 5,
    "train.checkpoint_interval": 6,
    "train.keep_checkpoints": 3,
    "train.method": "lora",
    "lora": LORA,
}
VOCAB = 264  # the built-in tokenizer's 260 ids, rounded up to a multiple of 8 by the presets
ADAPTER_FILE = "adapter_model.safetensors"
# besides the four adapter-sized tensor files: RNG states, state.json, config.json, headers
CHECKPOINT_OVERHEAD_BYTES = 64 * 1024


def adapter(output_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(output_dir / ADAPTER_FILE))


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def numel(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors.values())


def base_numel(config: dict[str, int], vocab_size: int) -> int:
    """Parameters of the untied Qwen3 base: embeddings, head, layers (with q/k norms)."""
    h, i, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    kv, d = config["num_key_value_heads"] * config["head_dim"], config["head_dim"]
    q = heads * d
    layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h + 2 * d
    return 2 * vocab_size * h + config["num_hidden_layers"] * layer + h


def fp32_base_host_bytes(config: dict[str, int], vocab_size: int) -> int:
    """The fp32 base's host bytes: its parameters and the rotary buffers (inv_freq and
    original_inv_freq, head_dim / 2 fp32 values each)."""
    return base_numel(config, vocab_size) * 4 + config["head_dim"] * 4


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    job_dir = make_job(tmp_path_factory.mktemp("lora") / "straight", SMALL_LORA)
    code, events = run(job_dir)
    assert code == 0, (job_dir / "worker.log").read_text()[-3000:]
    return job_dir, events


def test_lora_job_trains_only_the_adapter_and_checkpoints_it_alone(straight) -> None:
    job_dir, events = straight
    out = job_dir / "output"
    assert (out / "adapter_config.json").is_file() and (out / "tokenizer.json").is_file()
    assert not (out / "model.safetensors").exists() and not (out / "merged").exists()
    assert events[-1]["data"] == {
        "status": "succeeded",
        "step": STEPS,
        "output_model_path": str(out),
    }
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == LORA["rank"] and config["lora_alpha"] == LORA["alpha"]
    assert sorted(config["target_modules"]) == sorted(LORA["target_modules"])
    weights = adapter(out)
    assert weights and all(t.dtype == torch.float32 for t in weights.values())
    assert any(".lora_B." in k and t.abs().max() > 0 for k, t in weights.items())  # trained

    running = events[0]["data"]
    trainable = numel(weights)
    assert running["parameters"] == {
        "trainable": trainable,
        "total": base_numel(MODEL_CONFIG, VOCAB) + trainable,
        "base_host_bytes": fp32_base_host_bytes(MODEL_CONFIG, VOCAB),
    }
    steps = metrics(events)
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    assert steps[-1]["train_loss"] < steps[0]["train_loss"]

    # Every checkpoint is adapter-sized: the adapter's model copy, its fp32 master, Adam's
    # two moments, and small files; the frozen base (4x the adapter's bytes here) is absent.
    base_bytes = base_numel(MODEL_CONFIG, VOCAB) * 4
    checkpoints = [e["data"] for e in events if e["type"] == "checkpoint"]
    assert [c["step"] for c in checkpoints] == [6, 12, 16]
    for event in checkpoints:
        assert event["size_bytes"] <= 4 * nbytes(weights) + CHECKPOINT_OVERHEAD_BYTES
        assert event["size_bytes"] < base_bytes
    last = Path(checkpoints[-1]["path"])
    assert numel(load_file(str(last / "model.safetensors"))) == trainable
    assert numel(load_file(str(last / "master.safetensors"))) == trainable
    moments = load_file(str(last / "optimizer.safetensors"))
    assert numel({k: t for k, t in moments.items() if t.dim() > 0}) == 2 * trainable


def test_lora_pause_then_resume_is_bit_identical(straight, tmp_path: Path) -> None:
    straight_dir, straight_events = straight
    job_dir = make_job(tmp_path / "paused", SMALL_LORA)

    def pause_early(proc: subprocess.Popen[str], event: dict[str, Any]) -> None:
        if event["type"] == "metrics" and event["data"]["step"] == 2:
            proc.send_signal(signal.SIGUSR1)

    code, first = run(job_dir, pause_early)
    assert code == EXIT_PAUSED, (job_dir / "worker.log").read_text()[-3000:]
    paused = first[-1]["data"]
    assert paused["status"] == "paused" and 2 <= paused["step"] < STEPS
    assert not (job_dir / "output").exists()

    code, second = run(job_dir)
    assert code == 0, (job_dir / "worker.log").read_text()[-3000:]
    assert second[0]["data"]["step"] == paused["step"]
    resumed = metrics(first) + metrics(second)
    for got, want in zip(resumed, metrics(straight_events), strict=True):
        assert got["train_loss"] == want["train_loss"], got["step"]
        assert got["valid_loss"] == want["valid_loss"], got["step"]
    got, want = adapter(job_dir / "output"), adapter(straight_dir / "output")
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_a_rank_the_model_cannot_take_fails_the_job_naming_the_field(tmp_path: Path) -> None:
    # The daemon refuses this at submission; a worker given it anyway fails cleanly, before
    # it trains (in-process here: the failure comes before any device is used).
    import threading

    from rp_service.errors import JobFailure
    from rp_service.schemas import JobSpec
    from rp_service.spec_to_engine import spec_to_engine
    from rp_service.worker.training import JobPaths, run_job

    job_dir = make_job(tmp_path / "wide", {**SMALL_LORA, "lora": {"rank": 40}})
    payload = json.loads((job_dir / "spec.json").read_text())
    spec, paths = JobSpec.model_validate(payload["spec"]), JobPaths.from_json(payload["resolved"])
    with pytest.raises(JobFailure) as failure:
        run_job(spec, spec_to_engine(spec), paths, lambda *args, **kwargs: None, threading.Event())
    assert failure.value.code == "invalid_lora" and failure.value.param == "lora.rank"
    assert "use rank <= 32" in failure.value.message


# ---------------------------------------------------------------- through the daemon


def _base_model_dir(root: Path) -> Path:
    """A small Qwen3 saved as a Hugging Face directory, with the built-in tokenizer."""
    from rp_service.data.tokenizer import load_tokenizer
    from tests.tiny_models import tiny_model

    tokenizer = load_tokenizer(None)
    model = tiny_model("qwen3", seed=1, **MODEL_CONFIG, vocab_size=VOCAB, tie_word_embeddings=False)
    model_dir = root / "base"
    model.save_pretrained(str(model_dir), safe_serialization=True)
    tokenizer.save(model_dir)
    assert tokenizer.vocab_size <= VOCAB
    return model_dir


def _valid_loss(model: torch.nn.Module, seq_len: int) -> float:
    """Mean token loss of `model` over the synthetic validation set, as the worker computes it."""
    from rp_service.data.datasets import build_blocks
    from rp_service.data.tokenizer import load_tokenizer
    from rp_service.demo import SYNTHETIC_VALID_RECORDS, synthetic_records

    blocks = build_blocks(
        synthetic_records(SYNTHETIC_VALID_RECORDS, valid=True),
        "text",
        load_tokenizer(None),
        seq_len=seq_len,
        packing=True,
    )
    input_ids, labels = blocks.input_ids[:256].long(), blocks.labels[:256].long()  # as evaluate()
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100
    ).item()


def test_lora_job_through_the_daemon_loads_with_peft(make_daemon, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir = _base_model_dir(tmp_path)
    daemon: Daemon = make_daemon(
        RP_WORKER_MODULE="rp_service.worker",
        RP_MODEL_ROOTS=str(tmp_path),
        RP_KEEP_FINISHED_CHECKPOINTS="100",  # the test lists every checkpoint after the end
    )
    spec = {
        "name": "lora",
        "model": {"path": str(model_dir)},
        "data": {"train": "synthetic", "valid": "synthetic", "seq_len": 64},
        "train": {
            "method": "lora",
            "steps": 8,
            "batch_size": 4,
            "lr": 1e-2,
            "warmup_steps": 2,
            "eval_interval": 4,
            "checkpoint_interval": 4,
        },
        "lora": {**LORA, "merge": True},
        "engine": {"gpus": 0},
    }
    with daemon.client() as c:
        job = c.post("/v1/jobs", json=spec).json()
        assert job["parameters"] is None  # known once the worker has built the model
        done = daemon.wait_for(job["id"], {"succeeded", "failed", "cancelled"}, timeout_s=300)
        assert done["status"] == "succeeded", (done, c.get(f"/v1/jobs/{job['id']}/logs").text)
        checkpoints = c.get(f"/v1/jobs/{job['id']}/checkpoints").json()["data"]
        events = c.get(f"/v1/jobs/{job['id']}/events", params={"limit": 1000}).json()["data"]
    out = Path(done["output_model_path"])
    reported = next(
        e["data"]
        for e in events
        if e["type"] == "message" and e["data"].get("status") == "succeeded"
    )
    assert reported["merged_model_path"] == str(out / "merged")
    weights = adapter(out)
    trainable = numel(weights)
    total = base_numel(MODEL_CONFIG, VOCAB) + trainable
    assert done["parameters"] == {
        "trainable": trainable,
        "total": total,
        "base_host_bytes": fp32_base_host_bytes(MODEL_CONFIG, VOCAB),
    }
    assert [c["step"] for c in checkpoints] == [4, 8]
    for checkpoint in checkpoints:
        assert checkpoint["size_bytes"] <= 4 * nbytes(weights) + CHECKPOINT_OVERHEAD_BYTES

    # peft puts the adapter on the base the job started from; it gives the validation loss
    # the job reported, and the same logits as the merged model the job saved.
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(out)).eval()
    assert abs(_valid_loss(peft_model, 64) - done["metrics"]["valid_loss"]) < 1e-4
    merged = AutoModelForCausalLM.from_pretrained(str(out / "merged"), dtype=torch.float32).eval()
    ids = torch.randint(0, 260, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            merged(input_ids=ids).logits, peft_model(input_ids=ids).logits, rtol=1e-4, atol=1e-4
        )
    assert (out / "merged" / "tokenizer.json").is_file()


QLORA_STEPS = 4
SMALL_QLORA = {
    **SMALL_LORA,
    "model.quantization": "nf4",
    "train.steps": QLORA_STEPS,
    "train.eval_interval": 0,
    "train.checkpoint_interval": 2,
    "lora": {**LORA, "merge": True},
}
NF4_BLOCK = 64  # engine.adapters.nf4: a 4-byte absmax per 64 weights, two weights a byte


def projection_numel(config: dict[str, int]) -> int:
    """Weights of the seven linear projections of the layers (what nf4 packs)."""
    h, i = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    return config["num_hidden_layers"] * (2 * h * q + 2 * h * kv + 3 * h * i)


@pytest.fixture(scope="module")
def qlora(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    job_dir = make_job(tmp_path_factory.mktemp("qlora") / "straight", SMALL_QLORA)
    code, events = run(job_dir)
    assert code == 0, (job_dir / "worker.log").read_text()[-3000:]
    return job_dir, events


def test_qlora_job_succeeds_with_a_packed_base_and_adapter_sized_checkpoints(
    straight, qlora
) -> None:
    _, lora_events = straight
    job_dir, events = qlora
    out = job_dir / "output"
    assert events[-1]["data"]["status"] == "succeeded"
    weights = adapter(out)
    assert any(".lora_B." in k and t.abs().max() > 0 for k, t in weights.items())  # trained

    # The base as the host holds it: the projections packed, the rest (embeddings, head,
    # norms, buffers) in fp32 as in the plain LoRA job.
    counted = lora_events[0]["data"]["parameters"]
    plain_bytes = counted["base_host_bytes"]
    proj = projection_numel(MODEL_CONFIG)
    # codes and absmax, and each packed weight's stand-in (one fp32 NaN, broadcast)
    stand_ins = 7 * MODEL_CONFIG["num_hidden_layers"]
    packed = proj // 2 + proj // NF4_BLOCK * 4 + stand_ins * 4
    running = events[0]["data"]["parameters"]
    trainable = numel(weights)
    assert running == {
        "trainable": trainable,
        "total": counted["total"],
        "base_host_bytes": plain_bytes - 4 * proj + packed,
    }

    # Checkpoints hold the adapters only, as the plain LoRA job's do.
    checkpoints = [e["data"] for e in events if e["type"] == "checkpoint"]
    assert [c["step"] for c in checkpoints] == [2, 4]
    for event in checkpoints:
        assert event["size_bytes"] <= 4 * nbytes(weights) + CHECKPOINT_OVERHEAD_BYTES
    last = Path(checkpoints[-1]["path"])
    saved = load_file(str(last / "model.safetensors"))
    assert len(saved) == len(weights) and numel(saved) == trainable
    assert all(".lora_A." in k or ".lora_B." in k for k in saved), sorted(saved)

    # The merged export decodes the packed base: full-shape, finite weights.
    merged = load_file(str(out / "merged" / "model.safetensors"))
    assert numel(merged) == counted["total"] - trainable
    assert all(torch.isfinite(t).all() for t in merged.values())


def test_qlora_pause_then_resume_is_bit_identical(qlora, tmp_path: Path) -> None:
    """The resumed job rebuilds and re-quantizes the same base, and loads the adapters."""
    straight_dir, straight_events = qlora
    job_dir = make_job(tmp_path / "paused", SMALL_QLORA)

    def pause_early(proc: subprocess.Popen[str], event: dict[str, Any]) -> None:
        if event["type"] == "metrics" and event["data"]["step"] == 1:
            proc.send_signal(signal.SIGUSR1)

    code, first = run(job_dir, pause_early)
    assert code == EXIT_PAUSED, (job_dir / "worker.log").read_text()[-3000:]
    paused = first[-1]["data"]
    assert paused["status"] == "paused" and 1 <= paused["step"] < QLORA_STEPS
    code, second = run(job_dir)
    assert code == 0, (job_dir / "worker.log").read_text()[-3000:]
    resumed = metrics(first) + metrics(second)
    for got, want in zip(resumed, metrics(straight_events), strict=True):
        assert got["train_loss"] == want["train_loss"], got["step"]
    got, want = adapter(job_dir / "output"), adapter(straight_dir / "output")
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
