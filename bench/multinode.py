"""The rank entry point of multi-node jobs under torchrun: 1 "node" against 2 on one box.

What Ray's rank agents start on each node (`python -m rp_service.cluster.rank JOB_DIR`,
docs/SCALING.md), started here by one torchrun agent per "node" instead, with torchrun's
c10d rendezvous (`--nnodes N --nproc-per-node 1 --rdzv-backend c10d`), each agent seeing
its own GPU (CUDA_VISIBLE_DEVICES). The job is bench/service_train.py's: the Qwen3-1.7B
shape, random init, synthetic data, fp16 model, fp32 optimizer, at the same batch per node
(the global batch grows with the nodes: weak scaling, bench/scaling_model.py). Reads rank
0's metrics events and prints one JSON line per node count, then the speedup (the issue's
bar: 2 nodes >= 1.8x one node).

    python bench/multinode.py --nodes 1 2              # on a box with >= 2 GPUs
    python bench/multinode.py --model tiny --nodes 1 2 # CPU self-check (gloo, cpu:1)

`--network` turns NCCL's shared-memory and peer-to-peer paths off, so the two "nodes"
talk over sockets as two machines would (without it: the box's NVLink or PCIe).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.service_train import job_spec  # noqa: E402
from bench.shapes import SHAPES  # noqa: E402
from bench.train_args import TINY_DEFAULTS  # noqa: E402
from rp_service.schemas import JobSpec  # noqa: E402
from rp_service.spec_to_engine import spec_to_engine  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_job_dir(job_dir: Path, args: argparse.Namespace, nodes: int) -> None:
    """spec.json as the daemon writes it (rp_service.jobs.pipe), for `nodes` ranks."""
    per_node = argparse.Namespace(**{**vars(args), "seqs_per_step": args.seqs_per_node * nodes})
    spec = job_spec(per_node)
    spec["engine"]["nodes"] = nodes
    resolved = {
        "train_path": "synthetic",
        "valid_path": None,
        "model_path": None,
        "tokenizer_path": None,
        "output_dir": str(job_dir / "output"),
        "checkpoint_dir": str(job_dir / "checkpoints"),
        "min_free_bytes": 0,
    }
    shutil.rmtree(job_dir, ignore_errors=True)  # an earlier run's
    job_dir.mkdir(parents=True)
    # the engine options as the daemon maps them at submission (the worker takes them as given)
    options = spec_to_engine(JobSpec.model_validate(spec)).to_json()
    payload = {
        "job_id": f"bench-{nodes}",
        "attempt": 1,
        "spec": spec,
        "options": options,
        "resolved": resolved,
    }
    (job_dir / "spec.json").write_text(json.dumps(payload))


def _visible_gpu(node: int) -> str:
    """The GPU a node gets: the node-th of this process's visible GPUs (CUDA_VISIBLE_DEVICES
    as given: a test confined to GPUs 1,2 must not send node 0 to GPU 0)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    ids = [g.strip() for g in visible.split(",") if g.strip()] if visible else []
    return ids[node] if node < len(ids) else str(node)


def run_nodes(
    args: argparse.Namespace, nodes: int, work: Path, *, keep: bool = False
) -> dict[str, Any]:
    """Train with `nodes` torchrun agents; rank 0's per-step rates (`keep`: the job's
    folder stays, with its output, as tests/gpu/test_multinode_gpu.py reads it)."""
    job_dir = work / f"nodes-{nodes}"
    write_job_dir(job_dir, args, nodes)
    port = _free_port()
    agents = []
    for node in range(nodes):
        # the repository first, then whatever the caller had (the device's carried wheels)
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")
        # the tiny shape on the CPU, unless asked for GPUs (tests/gpu/test_multinode_gpu.py)
        if not getattr(args, "gpu", args.model != "tiny"):
            env.update(RP_DEVICES="cpu:1", CUDA_VISIBLE_DEVICES="")
        else:
            env.update(RP_DEVICES="cuda", CUDA_VISIBLE_DEVICES=_visible_gpu(node))
        if args.network:
            env.update(NCCL_SHM_DISABLE="1", NCCL_P2P_DISABLE="1")
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(nodes), "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", f"bench-multinode-{nodes}",
            "-m", "rp_service.cluster.rank", str(job_dir),
        ]  # fmt: skip
        out = (work / f"nodes-{nodes}-agent-{node}.out").open("w")
        agents.append((subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT), out))
    codes = [proc.wait(timeout=args.timeout_s) for proc, _ in agents]
    for _, out in agents:
        out.close()
    tokens_per_step = args.seq_len * args.seqs_per_node * nodes
    rates: dict[int, float] = {}
    timings: dict[str, list[float]] = {}  # rank 0's optimizer-thread seconds, measured steps
    for node in range(nodes):
        for line in (work / f"nodes-{nodes}-agent-{node}.out").read_text().splitlines():
            if not line.startswith("{"):
                continue
            event = json.loads(line)
            data = event.get("data") or {}
            if event.get("type") == "metrics" and data.get("step_seconds"):
                # every rank reports the global step; the slowest rank's time counts
                step = int(data["step"])
                rate = tokens_per_step / float(data["step_seconds"])
                rates[step] = min(rates.get(step, rate), rate)
                if node == 0 and step > args.warmup:
                    for key, seconds in (data.get("optimizer") or {}).items():
                        timings.setdefault(key, []).append(float(seconds))
    measured = [rate for step, rate in sorted(rates.items()) if step > args.warmup]
    if not keep:
        shutil.rmtree(job_dir, ignore_errors=True)  # the 1.7B checkpoint is ~24 GB
    return {
        "bench": "multinode",
        "model": args.model,
        "nodes": nodes,
        "network": args.network,
        "exit_codes": codes,
        "tokens_per_node_step": args.seq_len * args.seqs_per_node,
        "tokens_per_s": round(statistics.median(measured), 1) if measured else None,
        "steps_measured": len(measured),
        "optimizer_s": {k: round(statistics.median(v), 4) for k, v in sorted(timings.items())},
        "job_dir": str(job_dir),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", choices=sorted(SHAPES), default="qwen3-1.7b")
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--seqs-per-node", type=int, default=None)
    p.add_argument("--num-microbatch", type=int, default=4)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--network", action="store_true", help="NCCL over sockets only")
    p.add_argument("--timeout-s", type=float, default=540.0)
    p.add_argument("--work-dir", type=Path, default=None)
    args = p.parse_args()
    full = {"seq_len": 2048, "seqs_per_node": 64, "steps": 5, "warmup": 3}
    tiny = {**TINY_DEFAULTS, "seqs_per_node": TINY_DEFAULTS["seqs_per_step"] // 2}
    for key, value in full.items():
        if getattr(args, key) is None:
            setattr(args, key, tiny[key] if args.model == "tiny" else value)
    if args.model == "tiny":
        args.num_microbatch = min(args.num_microbatch, 2)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="rp-multinode-"))
    results = {}
    for nodes in args.nodes:
        results[nodes] = run_nodes(args, nodes, work)
        print(json.dumps(results[nodes]), flush=True)
    base = results.get(1, {}).get("tokens_per_s")
    for nodes, result in results.items():
        if nodes > 1 and base and result["tokens_per_s"]:
            speedup = result["tokens_per_s"] / base
            line = {"bench": "multinode_speedup", "nodes": nodes, "speedup": round(speedup, 3)}
            if nodes == 2:
                line["at_least_1_8x"] = speedup >= 1.8
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
