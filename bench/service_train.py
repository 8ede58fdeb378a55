"""A training job through the service against bench/train.py with the same settings.

Starts a daemon (`python -m rp_service`) on a free loopback port with a fresh data dir,
submits a job of the bench/train.py shape (preset qwen3 with that config, random init,
synthetic data, fp16 model, fp32 optimizer, no clipping, no checkpoints or evaluation
before the end), reads its metrics events, then runs bench/train.py with the same shape,
sequence length, sequences per step, micro-batches and steps in a subprocess. Prints one
JSON line per system and one with the ratio (the issue's bar: within 3%).

    python bench/service_train.py --model qwen3-1.7b --steps 6 --warmup 3
    python bench/service_train.py --model tiny          # CPU self-check (RP_GPUS=none)

Several GPUs (issue 43: the daemon's job at >= 95% of the bench on the same GPUs):
`--gpus 2` gives the job `engine.gpus: 2` (`--gpu-mode` its engine.gpu_mode, auto by default)
and runs bench/train.py on cuda:0,1; `--step-staleness` applies to both (the service's
default is 0, bench/train.py's 1), and the job's line names the mode it ran in;
bench/train.py overlaps its calls where the job did (`--overlap-calls` sets the job's
engine.overlap_calls; auto by default).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.shapes import SHAPES  # noqa: E402
from bench.train_args import TINY_DEFAULTS  # noqa: E402

TERMINAL = {"succeeded", "failed", "cancelled"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job_spec(args: argparse.Namespace) -> dict[str, Any]:
    shape = dict(SHAPES[args.model])
    shape["max_position_embeddings"] = max(args.seq_len, 2048)
    # The built-in byte-level tokenizer of synthetic data has 260 ids.
    shape["vocab_size"] = max(shape["vocab_size"], 264)
    on_gpu = args.model != "tiny"
    return {
        "name": f"bench-{args.model}",
        "model": {"preset": "qwen3", "config": shape, "dtype": "float16" if on_gpu else "float32"},
        "data": {"train": "synthetic", "format": "text", "seq_len": args.seq_len, "packing": True},
        "train": {
            "steps": args.warmup + args.steps,
            "batch_size": args.seqs_per_step,
            "lr": 1e-5,
            "schedule": "constant",
            "warmup_steps": 0,
            "grad_clip": None,
            "eval_interval": 0,
            "checkpoint_interval": 0,
            "keep_checkpoints": 1,
        },
        "engine": {
            "num_microbatch": args.num_microbatch,
            "recompute_grain": "stage",
            "optim_dtype": "float32",
            "gpus": getattr(args, "gpus", 1) if on_gpu else 0,
            "async_step": True,
            # bench/multinode.py's namespace has neither: the service's defaults then
            **{
                key: getattr(args, key)
                for key in ("gpu_mode", "step_staleness", "overlap_calls")
                if getattr(args, key, None) is not None
            },
        },
    }


def run_service(args: argparse.Namespace) -> dict[str, Any]:
    tokens_per_step = args.seq_len * args.seqs_per_step
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="rp-bench-") as data_dir:
        token = secrets.token_hex(16)  # the daemon requires a token (docs/API.md)
        env = dict(
            os.environ, RP_PORT=str(port), RP_DATA_DIR=data_dir, RP_HOST="127.0.0.1", RP_TOKEN=token
        )
        http = httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=30)
        if args.model == "tiny":
            env["RP_GPUS"] = "none"
        daemon = subprocess.Popen([sys.executable, "-m", "rp_service"], env=env, cwd=ROOT)
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    if http.get(f"{base}/readyz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or daemon.poll() is not None:
                    raise RuntimeError("the daemon did not become ready")
                time.sleep(0.2)
            job = http.post(f"{base}/v1/jobs", json=job_spec(args)).json()
            if "id" not in job:
                raise RuntimeError(f"submission refused: {job}")
            after, rates, status = 0, {}, "queued"
            while status not in TERMINAL:
                page = http.get(
                    f"{base}/v1/jobs/{job['id']}/events",
                    params={"after": after, "limit": 1000},
                ).json()
                for ev in page["data"]:
                    after = ev["id"]
                    data = ev.get("data") or {}
                    if ev["type"] == "metrics" and data.get("step_seconds"):
                        # per step, like bench/train.py (tokens_per_second is a running mean)
                        rates[int(data["step"])] = tokens_per_step / float(data["step_seconds"])
                    if ev["type"] == "status" and data.get("status"):
                        status = data["status"]
                if not page["data"]:
                    time.sleep(0.5)
            final = http.get(f"{base}/v1/jobs/{job['id']}").json()
        finally:
            http.close()
            daemon.terminate()
            daemon.wait(timeout=120)
    measured = [rate for step, rate in sorted(rates.items()) if step > args.warmup]
    return {
        "bench": "service_train",
        "system": "service",
        "model": args.model,
        "status": final["status"],
        "error": final.get("error"),
        "tokens_per_s": round(statistics.median(measured), 1) if measured else None,
        "steps_measured": len(measured),
        "per_step_tokens_per_s": [round(r, 1) for _, r in sorted(rates.items())],
        "gpu_mode": final.get("gpu_mode"),
    }


def run_bench(args: argparse.Namespace, *, overlap_calls: bool = False) -> dict[str, Any]:
    """bench/train.py's line for the job's shape (`overlap_calls`: as the job ran)."""
    cmd = [
        sys.executable, str(ROOT / "bench" / "train.py"), "--model", args.model,
        "--seq-len", str(args.seq_len), "--seqs-per-step", str(args.seqs_per_step),
        "--num-microbatch", str(args.num_microbatch), "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--step-staleness", str(args.step_staleness),
    ]  # fmt: skip
    if overlap_calls:
        cmd.append("--overlap-calls")
    env = dict(os.environ)
    if args.model == "tiny":
        env["RP_DEVICES"] = "cpu:1"
    else:
        env["RP_DEVICES"] = "cuda:" + ",".join(str(k) for k in range(args.gpus))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:  # say why: its stderr's end (a traceback, a refusal)
        sys.stderr.write(done.stderr[-4000:])
        raise RuntimeError(f"bench/train.py exited with {done.returncode}: {' '.join(cmd)}")
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return next(d for d in lines if d.get("system") == "roundpipe")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", choices=sorted(SHAPES), default="qwen3-1.7b")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--seqs-per-step", type=int, default=None)
    p.add_argument("--num-microbatch", type=int, default=4)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--gpus", type=int, default=1, help="the job's engine.gpus (GPU runs)")
    p.add_argument("--gpu-mode", choices=["auto", "pipeline", "ranks"], default="auto")
    p.add_argument("--step-staleness", type=int, choices=[0, 1], default=0)
    p.add_argument(
        "--overlap-calls",
        choices=["auto", "true", "false"],
        default=None,
        help="the job's engine.overlap_calls (auto, true, false; default: the service's); "
        "bench/train.py then runs as the job did (its gpu_mode.overlap_calls)",
    )
    args = p.parse_args()
    if args.overlap_calls in ("true", "false"):  # the JobSpec's boolean
        args.overlap_calls = args.overlap_calls == "true"
    full = {"seq_len": 2048, "seqs_per_step": 64, "steps": 5, "warmup": 3}
    for key, value in full.items():
        if getattr(args, key) is None:
            setattr(args, key, TINY_DEFAULTS[key] if args.model == "tiny" else value)
    if args.model == "tiny":
        args.num_microbatch = min(args.num_microbatch, 2)
    service = run_service(args)
    print(json.dumps(service), flush=True)
    bench = run_bench(args, overlap_calls=bool((service["gpu_mode"] or {}).get("overlap_calls")))
    print(
        json.dumps(
            {k: bench.get(k) for k in ("bench", "system", "model", "tokens_per_s", "step_s")}
        ),
        flush=True,
    )
    if service["tokens_per_s"] and bench.get("tokens_per_s"):
        ratio = service["tokens_per_s"] / bench["tokens_per_s"]
        print(
            json.dumps(
                {
                    "bench": "service_vs_train",
                    "ratio": round(ratio, 4),
                    "within_3pct": ratio >= 0.97,
                }
            )
        )


if __name__ == "__main__":
    main()
