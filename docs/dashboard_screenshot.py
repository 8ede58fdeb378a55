"""Makes docs/dashboard.png: the demo job trained by the real worker, seen in the dashboard.

    PYTHONPATH=$PWD:$PWD/client python docs/dashboard_screenshot.py [--steps N]

Needs the dev extra (playwright) and Chromium at /usr/bin/chromium; runs on the CPU.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.integration.service_daemon import Daemon  # noqa: E402  (after the path is set)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120, help="screenshot after this step")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "dashboard.png")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rp-shot-") as tmp:
        daemon = Daemon(Path(tmp) / "data", {"RP_WORKER_MODULE": "rp_service.worker"})
        daemon.start()
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path="/usr/bin/chromium")
                page = browser.new_page(viewport={"width": 1100, "height": 760})
                page.goto(f"{daemon.base_url}/#/new")
                page.click("#load-demo")
                while "preset: qwen3" not in page.input_value("#spec"):
                    time.sleep(0.1)
                page.click("#submit-job")
                page.wait_for_url("**/#/jobs/job-*")
                job_id = page.url.split("#/jobs/")[1]
                daemon.wait_for_step(job_id, args.steps, timeout_s=1800)
                time.sleep(1.0)  # the stream's last frame drawn
                page.screenshot(
                    path=str(args.out), clip={"x": 0, "y": 0, "width": 1100, "height": 760}
                )
                browser.close()
        finally:
            daemon.stop()
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
