"""A stand-in for `python -m rp_service.worker JOB_DIR` that follows the worker protocol.

No model: each "step" sleeps FAKE_STEP_S seconds. It emits status/metrics/checkpoint
events on stdout, commits checkpoints by renaming a temporary directory, resumes from the
newest one, exits 143 on SIGTERM and checkpoints then exits 75 on SIGUSR1. The job's
`name` selects a misbehaviour: "fail-input" reports a bad-input error and exits 1,
"ignore-sigterm" ignores SIGTERM (so only the SIGKILL escalation stops it),
"sigkill-once" SIGKILLs itself after step 8 of its first attempt, "sigkill-always" after
step 3 of every attempt, "device-fault-once" reports a device fault on its first attempt,
"disk-full" meets ENOSPC at its second checkpoint and reports it as the real worker does;
with `train.sample_prompts` it emits a `sample` event at every evaluation step (each
completion names its prompt, step and attempt);
a name starting with "real" hands the job to the real worker (exec, same pid and pipes).
A `train.objective: dpo` job's metrics carry `FAKE_DPO_METRICS` too; a GRPO job's
(`train.objective: grpo`, or a name starting with "fake-grpo" while the schema lacks it)
carry `fake_grpo_metrics(step)`, and its samples a reward per grader; every metrics event
carries a `gpu_share` of its devices, each 50% busy.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

_flags = {"pause": False, "stop": False}
# A DPO job's TRL-named metrics, the same at every step (what the exporter must show).
FAKE_DPO_METRICS = {
    "rewards/chosen": 0.5,
    "rewards/rejected": -0.25,
    "rewards/accuracies": 0.75,
    "rewards/margins": 0.75,
    "logps/chosen": -12.5,
    "logps/rejected": -20.0,
}
# A GRPO job's graders (docs/RL.md): the second name looks like HTML, to stay text.
FAKE_GRADERS = ("exact", "<b>fuzzy</b>")


def fake_grpo_metrics(step: int) -> dict[str, Any]:
    """A GRPO job's metrics at `step` (the contract's names), each a simple function of it."""
    return {
        "reward_mean": step / 100,
        "reward_std": 0.5 / step,
        "rewards": {FAKE_GRADERS[0]: step / 50, FAKE_GRADERS[1]: 1 - 1 / step},
        "kl": 0.01 * step,
        "clip_fraction": 0.25,
        "completion_tokens_mean": 10.0 + step,
        "grader_errors": step % 2,
    }


def is_grpo(spec: dict[str, Any]) -> bool:
    return spec["train"].get("objective") == "grpo" or (spec.get("name") or "").startswith(
        "fake-grpo"
    )


_journal: list[Any] = []  # the open event journal, as the real worker keeps one


def emit(type_: str, message: str, data: dict[str, Any], level: str = "info") -> None:
    line = json.dumps({"type": type_, "level": level, "message": message, "data": data})
    for journal in _journal:
        journal.write(line + "\n")
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def newest_checkpoint(checkpoint_dir: Path) -> int:
    steps = [
        int(p.name.split("-")[1])
        for p in checkpoint_dir.glob("step-*")
        if p.is_dir() and (p / "state.json").is_file()
    ]
    return max(steps, default=0)


def save_checkpoint(checkpoint_dir: Path, step: int) -> Path:
    final = checkpoint_dir / f"step-{step}"
    tmp = checkpoint_dir / f".tmp-step-{step}"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "state.json").write_text(json.dumps({"step": step}))
    (tmp / "weights.bin").write_bytes(bytes(range(256)) * 5)
    os.replace(tmp, final)
    emit(
        "checkpoint",
        f"checkpoint at step {step}",
        {
            "step": step,
            "path": str(final),
            "metrics": {"train_loss": 1.0 / step},
            "size_bytes": 1300,
        },
    )
    return final


def fake_gpu_share() -> list[dict[str, Any]]:
    """A metrics event's gpu_share for the devices the daemon gave this worker
    (RP_DEVICES=cpu:N, or the GPUs of CUDA_VISIBLE_DEVICES as cuda:0..): each 50% busy."""
    devices = os.environ.get("RP_DEVICES", "cpu:1")
    if devices.startswith("cpu:"):
        names = [f"cpu-virtual:{i}" for i in range(int(devices[4:]))]
    else:
        gpus = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
        names = [f"cuda:{i}" for i in range(len(gpus))]
    return [{"device": n, "busy_fraction": 0.5, "busy_s": 0.01, "jobs": 4} for n in names]


def emit_samples(prompts: list[str], step: int, attempt: int, *, grpo: bool = False) -> None:
    completions = [f"{p} at step {step} (attempt {attempt})" for p in prompts]
    samples = [
        {"prompt": p, "completion": c, "tokens": len(c), "finish_reason": "length"}
        for p, c in zip(prompts, completions, strict=True)
    ]
    if grpo:  # a rollout's reward (i / 4 for the i-th) and each grader's score
        for i, sample in enumerate(samples):
            sample["reward"] = i / 4
            sample["rewards"] = {FAKE_GRADERS[0]: float(i % 2), FAKE_GRADERS[1]: 0.5}
    tokens = sum(len(c) for c in completions)
    data = {"step": step, "samples": samples, "tokens": tokens, "seconds": 0.0}
    emit("sample", f"step {step}: {len(samples)} samples, {tokens} tokens", data)


def main() -> int:
    job_dir = Path(sys.argv[1])
    payload = json.loads((job_dir / "spec.json").read_text())
    spec, resolved = payload["spec"], payload["resolved"]
    if (spec.get("name") or "").startswith("real"):
        os.execv(sys.executable, [sys.executable, "-m", "rp_service.worker", str(job_dir)])
    if payload.get("event_journal"):
        _journal.append(open(payload["event_journal"], "a", buffering=1))  # noqa: SIM115
    if spec.get("name") != "ignore-sigterm":
        signal.signal(signal.SIGTERM, lambda *_: _flags.update(stop=True))
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, lambda *_: _flags.update(pause=True))
    step_s = float(os.environ.get("FAKE_STEP_S", "0.05"))
    checkpoint_dir = Path(resolved["checkpoint_dir"])
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    min_free = int(resolved.get("min_free_bytes") or 0)
    print(f"fake worker attempt {payload['attempt']} pid {os.getpid()}", file=sys.stderr)
    if spec.get("name") == "fail-input":
        emit(
            "message",
            "data.train: line 3 is not valid JSON",
            {
                "code": "invalid_data",
                "message": "data.train: line 3 is not valid JSON",
                "param": "data.train",
            },
            level="error",
        )
        return 1
    if spec.get("name") == "device-fault-once" and payload["attempt"] == 1:
        message = "device fault: RuntimeError: CUDA error: an illegal memory access"
        emit("message", message, {"code": "device_fault", "message": message}, level="error")
        return 1
    kill_after = {"sigkill-always": 3, "sigkill-once": 8 if payload["attempt"] == 1 else 0}
    kill_at = kill_after.get(spec.get("name") or "", 0)
    total = spec["train"]["steps"] or round(spec["train"]["epochs"] * 10)
    interval = spec["train"]["checkpoint_interval"]
    start = newest_checkpoint(checkpoint_dir)
    emit("status", f"training from step {start}", {"status": "running", "resumed_from": start})
    for step in range(start + 1, total + 1):
        deadline = time.monotonic() + step_s
        while time.monotonic() < deadline and not _flags["stop"]:
            time.sleep(0.005)
        if _flags["stop"]:
            return 143
        emit(
            "metrics",
            f"step {step}/{total}",
            {
                "step": step,
                "total_steps": total,
                "epoch": step / total,
                "train_loss": 10.0 / step,
                "valid_loss": None,
                "learning_rate": spec["train"]["lr"],
                "grad_norm": 1.0,
                "tokens_per_second": 1000.0,
                "trained_tokens": step * 64,
                "gpu_mem_bytes": 0,
                "gpu_share": fake_gpu_share(),
                "eta_seconds": (total - step) * step_s,
                **(FAKE_DPO_METRICS if spec["train"].get("objective") == "dpo" else {}),
                **(fake_grpo_metrics(step) if is_grpo(spec) else {}),
            },
        )
        prompts = spec["train"].get("sample_prompts") or []
        eval_interval = spec["train"].get("eval_interval") or 0
        if prompts and ((eval_interval and step % eval_interval == 0) or step == total):
            emit_samples(prompts, step, payload["attempt"], grpo=is_grpo(spec))
        if spec.get("name") == "disk-full" and step == 2 * interval:
            from types import SimpleNamespace

            from rp_service.worker.main import _fail_for  # the real worker's report of the error

            where = str(checkpoint_dir / f".tmp-step-{step}" / "weights.bin")
            full = OSError(errno.ENOSPC, "No space left on device", where)
            return _fail_for(emit, full, SimpleNamespace(checkpoint_dir=checkpoint_dir))
        saved = bool(interval and step % interval == 0 and step < total)
        if saved and shutil.disk_usage(checkpoint_dir).free < min_free:
            # As the real worker (rp_service.worker.checkpoint): refused before a byte.
            from types import SimpleNamespace

            from rp_service.worker.main import _fail_for

            below = f"below RP_MIN_FREE_BYTES={min_free}"
            full = OSError(errno.ENOSPC, below, str(checkpoint_dir))
            return _fail_for(emit, full, SimpleNamespace(checkpoint_dir=checkpoint_dir))
        if saved:
            save_checkpoint(checkpoint_dir, step)
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if _flags["pause"] and step < total:
            if not saved:  # a pause on a checkpoint step keeps the one just written
                save_checkpoint(checkpoint_dir, step)
            emit("status", f"paused at step {step}", {"status": "paused", "step": step})
            return 75
    output = Path(resolved["output_dir"])
    output.mkdir(parents=True, exist_ok=True)
    (output / "config.json").write_text("{}")
    emit("status", "training done", {"status": "succeeded", "output_model_path": str(output)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
