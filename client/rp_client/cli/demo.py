"""`rp demo`: a local daemon, the embedded demo job, followed to the end."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import typer

from .._client import Client
from ..errors import APIError
from ._app import EXIT_FAILED, EXIT_USAGE, app, exit_code_for, fail, job_exit_code
from ._daemon import (
    INSTALL_HINT,
    DaemonStartError,
    daemon_env,
    dashboard_url,
    free_port,
    server_installed,
    start_daemon,
    stop_daemon,
    tail,
    token_file,
    wait_ready,
)
from .progress import follow_job, report_outcome

_LORA_DEMO_LR = 1e-2
_DPO_DEMO_BETA = 0.1
# `--grpo`: prompts "say y <n>" (the daemon's synthetic prompt rows), rewarded when the
# answer holds a "y"; the tiny demo model learns it in a few dozen steps on the CPU.
_GRPO_DEMO = {
    "grpo": {"group_size": 8, "max_completion_tokens": 12, "sample_interval": 5},
    "grader": {
        "type": "string_check",
        "name": "has_y",
        "input": "{{sample.output_text}}",
        "reference": "{{item.answer}}",
        "operation": "like",
    },
}
_GRPO_DEMO_TRAIN = {
    "steps": 30,
    "lr": 3e-3,
    "warmup_steps": 0,
    "eval_interval": 10,
    "checkpoint_interval": 10,
}


@app.command()
def demo(
    data_dir: Path = typer.Option(
        None, "--data-dir", help="Daemon data directory (default: a new temporary one, kept)."
    ),
    gpus: str = typer.Option(None, "--gpus", help="all | none | ids [RP_GPUS]."),
    json_lines: bool = typer.Option(False, "--json", help="Events as JSON lines."),
    start_timeout_s: float = typer.Option(
        180.0, "--start-timeout", help="Seconds to wait for readiness."
    ),
    lora: bool = typer.Option(
        False,
        "--lora",
        help="Train LoRA adapters on the frozen demo model (train.method lora) and save the "
        "adapter plus the merged model.",
    ),
    steps: int = typer.Option(
        None, "--steps", min=1, help="Optimizer steps instead of the demo's own."
    ),
    quantization: str = typer.Option(
        "none",
        "--quantization",
        help="none | nf4: hold the frozen demo model 4-bit in host memory (QLoRA, "
        "model.quantization); nf4 needs --lora.",
    ),
    dpo: bool = typer.Option(
        False,
        "--dpo",
        help="Preference-tune the demo model with DPO (train.objective dpo) on generated "
        "pairs: a counting prompt, its continuation preferred over a repeated number.",
    ),
    grpo: bool = typer.Option(
        False,
        "--grpo",
        help="Reinforcement-tune the demo model with GRPO (train.objective grpo) on generated "
        "prompts, a string_check grader rewarding answers that hold a 'y' (docs/RL.md).",
    ),
) -> None:
    """Start a local daemon, train the embedded demo model, print where it is saved."""
    if quantization not in ("none", "nf4"):
        raise fail(f"--quantization must be none or nf4, got {quantization!r}", EXIT_USAGE)
    if quantization == "nf4" and not lora:
        raise fail(
            "--quantization nf4 freezes the base in 4 bits, which only adapters can train "
            "on; add --lora",
            EXIT_USAGE,
        )
    if dpo and grpo:
        raise fail("--dpo and --grpo are two objectives: give one", EXIT_USAGE)
    if not server_installed():
        raise fail(INSTALL_HINT, EXIT_FAILED)
    data = (data_dir or Path(tempfile.mkdtemp(prefix="rp-demo-"))).resolve()
    data.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = data / "daemon.log"
    say = (lambda m: None) if json_lines else (lambda m: sys.stderr.write(m + "\n"))
    say(f"starting a RoundPipe daemon on {url} (data in {data}, log in {log_path})")
    env = daemon_env(host="127.0.0.1", port=port, data_dir=data, gpus=gpus)
    env.pop("RP_URL", None)
    token_path = token_file(env)
    with (
        log_path.open("ab") as log,
        Client(url, token=env.get("RP_TOKEN"), token_file=token_path) as client,
    ):
        proc = start_daemon(env, log)
        try:
            wait_ready(client, proc, start_timeout_s)
            say(
                f"dashboard: {dashboard_url(env)} (live loss curves while the demo trains; "
                "the daemon stops when it ends)"
            )
            if not env.get("RP_TOKEN"):
                say(f"token: in {token_path} (the dashboard asks for it once)")
            job = client.jobs.create(
                _demo_body(
                    client.demo_spec(),
                    lora=lora,
                    steps=steps,
                    dpo=dpo,
                    grpo=grpo,
                    quantization=quantization,
                )
            )
            say(f"submitted {job.id}")
            job = follow_job(client, job.id, json_lines=json_lines)
        except DaemonStartError as exc:
            raise fail(f"{exc}; last lines of {log_path}:\n{tail(log_path)}") from None
        except APIError as exc:
            raise fail(str(exc), exit_code_for(exc)) from None
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None
        finally:
            say("stopping the daemon")
            stop_daemon(proc)
    if not json_lines:
        report_outcome(job)
        if job.status == "succeeded" and job.output_model_path:
            model_path = (
                str(Path(job.output_model_path) / "merged") if lora else job.output_model_path
            )
            sys.stdout.write(
                f"load it with: transformers.AutoModelForCausalLM.from_pretrained({model_path!r})\n"
            )
    raise typer.Exit(job_exit_code(job))


def _demo_body(
    spec: dict[str, Any],
    *,
    lora: bool,
    steps: int | None,
    dpo: bool = False,
    grpo: bool = False,
    quantization: str = "none",
) -> dict[str, Any]:
    """The demo spec, as LoRA (with the merged model saved), over a 4-bit base (QLoRA), as
    DPO on generated preference pairs, as GRPO on generated prompts, and/or with other step
    counts."""
    train = dict(spec.get("train") or {})
    if grpo:
        train.update(_GRPO_DEMO_TRAIN, objective="grpo")
        data = {**(spec.get("data") or {}), "format": "auto"}
        spec = {**spec, "data": data, **_GRPO_DEMO}
    if steps is not None:
        train.update(steps=steps, epochs=None)
        # keep a checkpoint and an evaluation inside a short run
        for key in ("eval_interval", "checkpoint_interval"):
            if isinstance(train.get(key), int) and train[key] > steps:
                train[key] = steps
    if lora:
        train["method"] = "lora"
        # LoRA's usual learning rate is several times full fine-tuning's
        train["lr"] = _LORA_DEMO_LR
        spec = {**spec, "lora": {"rank": 16, "alpha": 32.0, "merge": True}}
    if quantization != "none":
        spec = {**spec, "model": {**(spec.get("model") or {}), "quantization": quantization}}
    if dpo:
        # "synthetic" data of a DPO job is generated pairs (rp_service.data.preference)
        train["objective"] = "dpo"
        data = {**(spec.get("data") or {}), "format": "preference"}
        spec = {**spec, "data": data, "dpo": {"beta": _DPO_DEMO_BETA}}
    return {**spec, "train": train}
