"""The names of a GRPO step's reward metrics (issue 48's contract), and their flat columns.

The objective emits them in each `metrics` event; the job's summary, the metric series
(`GET /v1/jobs/{id}/metrics`) and the dashboard read them by these names. `rewards` is a
mapping grader name -> mean score; its flat column is `grader/<name>`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["GRADER_COLUMN_PREFIX", "REWARD_METRICS", "reward_columns"]

REWARD_METRICS: tuple[str, ...] = (
    "reward_mean",
    "reward_std",
    "kl",
    "clip_fraction",
    "completion_tokens_mean",
    "grader_errors",
)
GRADER_COLUMN_PREFIX = "grader/"


def reward_columns(data: Mapping[str, Any]) -> dict[str, float | int]:
    """The numeric reward metrics of one metrics event, each grader's as `grader/<name>`."""
    out: dict[str, float | int] = {
        key: data[key]
        for key in REWARD_METRICS
        if isinstance(data.get(key), int | float) and not isinstance(data.get(key), bool)
    }
    rewards = data.get("rewards")
    if isinstance(rewards, Mapping):
        for name, value in rewards.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[f"{GRADER_COLUMN_PREFIX}{name}"] = value
    return out
