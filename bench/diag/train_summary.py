"""The figures of bench/train.py's JSON lines that a device call's output shows, one dict a
line: `python3 bench/diag/train_summary.py RUN.jsonl [...]`."""

from __future__ import annotations

import json
import sys

KEYS = (
    "num_devices",
    "tokens_per_s",
    "tokens_per_s_steps_without_compile",
    "step_s",
    "steps_with_compile",
    "plan",
    "peak_host_mem_gib",
    "plan_host_gib",
)

for path in sys.argv[1:]:
    with open(path) as f:
        for line in f:
            if line.startswith("{"):
                run = json.loads(line)
                print({k: run.get(k) for k in KEYS})
