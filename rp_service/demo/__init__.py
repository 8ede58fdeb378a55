"""The embedded demo: a tiny Qwen3-shaped model trained on synthetic text in about a minute.

`demo_spec()` is the JobSpec that ``GET /v1/demo`` serves and ``rp demo`` submits.
`synthetic_records()` generates its data ("synthetic" in ``data.train`` / ``data.valid``):
short stories built from templates and small word lists, so a byte-level model can learn
the words, the grammar and the repeated phrases quickly and its loss falls clearly.
"""

from __future__ import annotations

import json
import random
from importlib import resources
from typing import Any

__all__ = [
    "SYNTHETIC",
    "SYNTHETIC_TRAIN_RECORDS",
    "SYNTHETIC_VALID_RECORDS",
    "demo_spec",
    "synthetic_records",
]

SYNTHETIC = "synthetic"
"""The dataset name that selects generated data instead of a file."""
SYNTHETIC_TRAIN_RECORDS = 2000
SYNTHETIC_VALID_RECORDS = 64
# The validation stories come from another stream than the training ones.
_VALID_SEED_OFFSET = 7_919

_NAMES = ("anna", "ben", "cleo", "dev", "emma", "finn", "gita", "hugo")
_ANIMALS = ("cat", "dog", "fox", "owl", "bear", "frog", "goat", "duck")
_COLOURS = ("red", "blue", "green", "brown", "white", "black")
_PLACES = ("the park", "the river", "the market", "the hill", "the garden", "the lake")
_THINGS = ("apples", "books", "stones", "shells", "coins", "flowers")
_VERBS = ("sees", "follows", "finds", "greets", "chases", "helps")
_NUMBERS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def demo_spec() -> dict[str, Any]:
    """The demo JobSpec as a JSON-ready dict (a fresh copy on every call)."""
    text = resources.files(__package__).joinpath("demo_spec.json").read_text(encoding="utf-8")
    return json.loads(text)


def _sentence(rng: random.Random, name: str) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        return (
            f"{name} {rng.choice(_VERBS)} a {rng.choice(_COLOURS)} {rng.choice(_ANIMALS)} "
            f"near {rng.choice(_PLACES)}."
        )
    if kind == 1:
        a, b = rng.randrange(1, 5), rng.randrange(1, 5)
        return (
            f"{name} has {_NUMBERS[a - 1]} {rng.choice(_THINGS)} and finds {_NUMBERS[b - 1]} "
            f"more, so {name} has {_NUMBERS[a + b - 1]}."
        )
    if kind == 2:
        return f"every morning {name} walks to {rng.choice(_PLACES)} and back home."
    count = rng.randrange(3, 7)
    return "counting: " + " ".join(_NUMBERS[:count]) + "."


def synthetic_records(count: int, *, seed: int = 0, valid: bool = False) -> list[dict[str, str]]:
    """`count` text records ``{"text": ...}``, deterministic in `seed` (and `valid`)."""
    rng = random.Random(seed + (_VALID_SEED_OFFSET if valid else 0))
    records = []
    for _ in range(count):
        name = rng.choice(_NAMES)
        story = " ".join(_sentence(rng, name) for _ in range(rng.randrange(2, 5)))
        records.append({"text": f"a story about {name}. {story}"})
    return records
