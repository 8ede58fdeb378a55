"""The two maps stay whole: docs/ARCHITECTURE.md names every module of engine/ and
rp_service/, tests/README.md every test file. A module or test added without its line
fails here, not in a reader's search."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _named(text: str, name: str) -> bool:
    """`name` appears as a word of its own (`store_io` or `store_io.py`, not `store_iox`)."""
    return re.search(rf"(?<![\w.]){re.escape(name)}(\.py)?(?!\w)", text) is not None


def test_architecture_names_every_module() -> None:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    modules = [
        path
        for package in ("engine", "rp_service")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path.name != "__init__.py"
    ]
    assert len(modules) > 50  # the walk found the packages
    missing = [str(p.relative_to(ROOT)) for p in modules if not _named(text, p.stem)]
    assert missing == [], f"docs/ARCHITECTURE.md does not map {missing}"


def test_tests_readme_names_every_test_file() -> None:
    text = (ROOT / "tests" / "README.md").read_text()
    files = sorted((ROOT / "tests").rglob("test_*.py"))
    assert len(files) > 100
    missing = [str(p.relative_to(ROOT)) for p in files if p.name not in text]
    assert missing == [], f"tests/README.md does not map {missing}"


def test_the_word_match_is_exact() -> None:
    assert _named("`jobs/store_io.py` the store's threads", "store_io")
    assert _named("store_io, retention", "retention")
    assert not _named("store_iox", "store_io")
    assert not _named("jobs.store_io", "store_io")
