"""One real run: the daemon with `rp_service.worker` trains the embedded demo on the CPU."""

from __future__ import annotations

from pathlib import Path

from tests.integration.service_daemon import Daemon


def test_the_demo_trains_with_the_real_worker(make_daemon) -> None:
    daemon: Daemon = make_daemon(RP_WORKER_MODULE="rp_service.worker")
    with daemon.client() as c:
        demo = c.get("/v1/demo").json()
        demo["train"].update(steps=6, checkpoint_interval=3, eval_interval=3, keep_checkpoints=1)
        job = c.post("/v1/jobs", json=demo).json()
        done = daemon.wait_for(job["id"], {"succeeded", "failed", "cancelled"}, timeout_s=300)
        assert done["status"] == "succeeded", (done, c.get(f"/v1/jobs/{job['id']}/logs").text)
        assert done["progress"]["step"] == 6 and done["trained_tokens"] > 0
        assert (Path(done["output_model_path"]) / "config.json").is_file()
        events = c.get(f"/v1/jobs/{job['id']}/events", params={"limit": 1000}).json()["data"]
        assert [e["data"]["step"] for e in events if e["type"] == "metrics"] == list(range(1, 7))
        kept = c.get(f"/v1/jobs/{job['id']}/checkpoints").json()["data"]
        assert len(kept) == 1  # keep_checkpoints=1: pruned ones are not listed
        tar = c.get(f"/v1/jobs/{job['id']}/checkpoints/{kept[0]['step']}/content")
        assert tar.status_code == 200 and len(tar.content) > kept[0]["size_bytes"] // 2
