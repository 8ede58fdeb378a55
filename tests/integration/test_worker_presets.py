"""A job of a mixture-of-experts preset runs through the real worker: trains, evaluates,
checkpoints and saves a model that transformers loads back as the same class."""

from __future__ import annotations

from pathlib import Path

from .test_worker import make_job, metrics, run

MOE_JOB = {
    "model.preset": "qwen3_moe",
    "model.config": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": 64,
    },
    "data.seq_len": 32,
    "train.batch_size": 4,
    "train.steps": 6,
    "train.warmup_steps": 1,
    "train.eval_interval": 3,
    "train.checkpoint_interval": 6,
}


def test_qwen3_moe_job_end_to_end(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    job_dir = make_job(tmp_path / "moe", MOE_JOB)
    code, events = run(job_dir)
    assert code == 0, (job_dir / "worker.log").read_text()[-3000:]
    assert events[-1]["data"]["status"] == "succeeded"
    steps = metrics(events)
    assert [m["step"] for m in steps] == list(range(1, 7))
    assert all(m["grad_norm"] > 0 for m in steps)
    assert [m["step"] for m in steps if m["valid_loss"] is not None] == [3, 6]
    model = AutoModelForCausalLM.from_pretrained(str(job_dir / "output"))
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
