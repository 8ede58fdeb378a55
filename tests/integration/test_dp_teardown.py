"""Data parallel teardown: rank processes that end as user scripts do exit with status 0.

Each run is two gloo ranks (`python -m tests.integration.dp_worker`, its main block): three
asynchronous steps, synchronize, a checkpoint, destroy_process_group(), then the
interpreter's own exit. Before RoundPipe closed itself at exit, about one run in ten
ended with a rank killed by SIGABRT ("terminate called without an active exception"): a
gloo worker thread still freeing its last collective when the interpreter finalized.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNS = 30
WORLD = 2
AT_ONCE = 2  # runs in flight together (four processes): import time dominates a run
RUN_TIMEOUT_S = 90.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(run_dir: Path) -> list[subprocess.Popen[bytes]]:
    run_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("RP_DEVICES", None)
    port = str(_free_port())
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.integration.dp_worker",
                str(r),
                str(WORLD),
                port,
                str(run_dir),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=(run_dir / f"rank{r}.log").open("wb"),
        )
        for r in range(WORLD)
    ]


def test_async_steps_then_destroy_exit_cleanly_30_times(tmp_path: Path) -> None:
    todo = list(range(RUNS))
    running: dict[int, tuple[float, list[subprocess.Popen[bytes]]]] = {}
    codes: dict[int, list[int]] = {}
    while todo or running:
        while todo and len(running) < AT_ONCE:
            k = todo.pop(0)
            running[k] = (time.monotonic(), _start(tmp_path / f"run{k}"))
        for k, (started, procs) in list(running.items()):
            if all(p.poll() is not None for p in procs):
                codes[k] = [int(p.returncode) for p in procs]
                del running[k]
            elif time.monotonic() - started > RUN_TIMEOUT_S:
                for p in procs:
                    p.kill()
                    p.wait()
                codes[k] = [int(p.returncode) for p in procs]
                del running[k]
        time.sleep(0.05)
    failed = {k: c for k, c in codes.items() if c != [0] * WORLD}
    logs = [
        f"run {k}: exit codes {c}\n" + (tmp_path / f"run{k}" / f"rank{r}.log").read_text()[-800:]
        for k, c in sorted(failed.items())
        for r in range(WORLD)
        if c[r] != 0
    ]
    assert not failed, f"{len(failed)} of {RUNS} runs had a rank fail:\n" + "\n".join(logs)
    for k in range(RUNS):  # rank 0 wrote the checkpoint before the end
        assert (tmp_path / f"run{k}" / "ckpt.pt").exists()
