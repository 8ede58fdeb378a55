"""`rp system`: what the daemon runs on."""

from __future__ import annotations

import sys
from typing import Any

import typer

from ..models import Cluster, GpuShare
from ._app import app, get_client, handle_errors, print_json


def _gib(n: int | None) -> str:
    return f"{n / 2**30:.1f} GiB" if isinstance(n, int) else "-"


@app.command()
@handle_errors
def system(
    ctx: typer.Context, json_lines: bool = typer.Option(False, "--json", help="The raw object.")
) -> None:
    """Show the daemon's versions, devices, memory, C Adam build, queue, each GPU's
    job and busy share, and the Ray cluster's nodes."""
    info = get_client(ctx).system()
    if json_lines:
        print_json(info.model_dump(mode="json"))
        return
    out = [f"version          {info.version or '-'}"]
    for name, version in info.versions.items():
        out.append(f"  {name:<15}{version}")
    out.append(f"devices          {len(info.devices)}")
    for device in info.devices:
        out.append(f"  {_device_line(device)}")
    out.append(f"host memory      {_gib(info.host_memory_bytes)}")
    out.append(f"pinned budget    {_gib(info.pinned_budget_bytes)}")
    out.append(f"job host budget  {_gib(info.host_memory_budget_bytes)}")
    if info.adam:
        out.append(
            f"adam             {info.adam.get('isa', '-')}, {info.adam.get('threads', '-')} threads"
        )
    out.append(f"queue length     {info.queue_length}")
    counts = ", ".join(f"{k} {v}" for k, v in info.jobs.items()) or "-"
    out.append(f"jobs             {counts}")
    out += _share_lines(info.gpu_share)
    out += _cluster_lines(info.cluster)
    sys.stdout.write("\n".join(out) + "\n")


def _device_line(device: Any) -> str:
    """'0  NVIDIA H100 80GB HBM3  capability 9.0  79.1 GiB  fp8 yes' (a probe's fields)."""
    if not isinstance(device, dict) or "name" not in device:
        return str(device)
    fp8 = {True: "yes", False: "no"}.get(device.get("fp8"), "-")
    return (
        f"{device.get('index', '-')}  {device['name']}  capability "
        f"{device.get('capability', '-')}  {_gib(device.get('total_memory_bytes'))}  fp8 {fp8}"
    )


def _share_lines(rows: list[GpuShare]) -> list[str]:
    """Each GPU's job and the share of its latest step it was busy (docs/PERFORMANCE.md)."""
    if not rows:
        return []
    out = ["gpu share        device, job, busy in its latest step"]
    for row in rows:
        if row.job_id is None:
            out.append(f"  {row.device:<15}free")
            continue
        busy = "-" if row.busy_fraction is None else f"{row.busy_fraction:.0%}"
        detail = "" if row.step is None else f" (step {row.step}, {row.jobs} jobs)"
        out.append(f"  {row.device:<15}{row.job_id}  {busy:>4} busy{detail}")
    return out


def _cluster_lines(cluster: Cluster | None) -> list[str]:
    """The Ray cluster's nodes (multi-node jobs, RP_RAY_ADDRESS): resources and jobs."""
    if cluster is None:
        return []
    out = [f"cluster          {cluster.address}, {len(cluster.nodes)} nodes"]
    if cluster.error:
        out.append(f"  unreachable: {cluster.error}")
    for node in cluster.nodes:
        jobs = ", ".join(node.jobs) or "free"
        out.append(
            f"  {node.address or '-':<15}{node.gpus} GPU, {node.cpus} CPU, "
            f"{_gib(node.memory_bytes)}  {jobs}"
        )
    return out
