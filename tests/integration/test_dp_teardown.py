"""Data parallel teardown: rank processes that end as user scripts do exit with status 0.

Each run is two gloo ranks forked by `python -m tests.integration.dp_worker` (its main
block: torch and the engine imported once, before any thread starts, then two processes a
run): three asynchronous steps, synchronize, a checkpoint, destroy_process_group(), then
the interpreter's own exit. Before RoundPipe closed itself at exit, about one run in ten
ended with a rank killed by SIGABRT ("terminate called without an active exception"): a
gloo worker thread still freeing its last collective when the interpreter finalized.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNS = 30
WORLD = 2
AT_ONCE = 2  # runs in flight together (four processes)
RUN_TIMEOUT_S = 90.0


def test_async_steps_then_destroy_exit_cleanly_30_times(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("RP_DEVICES", None)
    args = [str(tmp_path), str(RUNS), str(WORLD), str(AT_ONCE), str(RUN_TIMEOUT_S)]
    launcher = subprocess.run(
        [sys.executable, "-m", "tests.integration.dp_worker", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUNS * RUN_TIMEOUT_S,
    )
    assert launcher.returncode == 0, launcher.stderr[-3000:]
    codes = {int(k): c for k, c in json.loads((tmp_path / "codes.json").read_text()).items()}
    assert sorted(codes) == list(range(RUNS))
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
