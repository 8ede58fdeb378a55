"""bench/chat_latency.py --tiny: the serving path end to end on the CPU, rows as documented."""

from __future__ import annotations


def test_tiny_chat_latency_bench_reports_cold_and_warm() -> None:
    from bench import chat_latency

    cold, warm = chat_latency.main(["--tiny", "--repeats", "2", "--max-tokens", "6"])
    assert (cold["phase"], warm["phase"]) == ("cold", "warm")
    for row in (cold, warm):
        assert row["bench"] == "chat_latency" and row["adapter"] is True
        assert row["device"] == "cpu" and row["model"] == "random-tiny"
        assert 1 <= row["completion_tokens"] <= 6 and row["prompt_tokens"] > 0
        assert row["ttft_s"] > 0
    assert cold["load_s"] > 0 and cold["ttft_s"] > cold["load_s"]  # the load comes first
    assert warm["repeats"] == 2
