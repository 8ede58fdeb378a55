"""The client distribution installs into a fresh virtual environment that has no torch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_client_installs_and_imports_without_torch(tmp_path):
    # A copy, so the build leaves nothing (build/, *.egg-info) in the work tree.
    source = tmp_path / "client"
    shutil.copytree(ROOT / "client", source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True, system_site_packages=False)
    python = env_dir / ("Scripts" if sys.platform == "win32" else "bin") / "python"

    install = subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert install.returncode == 0, install.stdout + install.stderr

    probe = (
        "import importlib.util, sys\n"
        "import rp_client, rp_client.cli\n"
        "from rp_client import Client, AsyncClient\n"
        "assert importlib.util.find_spec('torch') is None, 'torch is importable'\n"
        "assert 'torch' not in sys.modules\n"
        "assert importlib.util.find_spec('rp_service') is None\n"
        "print(rp_client.__version__)\n"
    )
    # The venv's own path only: a PYTHONPATH pointing at a checkout would make rp_service
    # importable and hide what the client's install alone brings.
    clean_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [str(python), "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
        env=clean_env,
    )
    assert result.returncode == 0, result.stdout + result.stderr

    rp = env_dir / "bin" / "rp"
    help_text = subprocess.run(
        [str(rp), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
        env=clean_env,
    )
    assert help_text.returncode == 0 and "demo" in help_text.stdout

    # Without the server, `rp serve` says how to install it instead of a traceback.
    serve = subprocess.run(
        [str(rp), "serve"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
        env=clean_env,
    )
    assert serve.returncode == 1
    assert serve.stderr.startswith("error: the RoundPipe server is not installed")
    assert "Traceback" not in serve.stderr
