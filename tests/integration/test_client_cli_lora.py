"""`rp demo --lora` as a user runs it: a daemon, the demo as a LoRA job, adapter + merged model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .test_client_cli import rp_env


def test_rp_demo_lora_end_to_end(tmp_path: Path) -> None:
    data_dir = tmp_path / "demo"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rp_client",
            "demo",
            "--lora",
            "--steps",
            "12",
            "--data-dir",
            str(data_dir),
            "--gpus",
            "none",
        ],
        env=rp_env(None),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    daemon_log = data_dir / "daemon.log"
    log_text = daemon_log.read_text(errors="replace")[-3000:] if daemon_log.exists() else ""
    assert result.returncode == 0, result.stderr[-3000:] + log_text
    line = next(ln for ln in result.stdout.splitlines() if " succeeded; adapter: " in ln)
    adapter_dir = Path(line.split(" succeeded; adapter: ")[1])
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["r"] == 16 and (adapter_dir / "adapter_model.safetensors").is_file()
    merged = adapter_dir / "merged"
    assert (merged / "config.json").is_file() and list(merged.glob("*.safetensors"))
    assert f"from_pretrained({str(merged)!r})" in result.stdout
    assert "Traceback" not in result.stderr
