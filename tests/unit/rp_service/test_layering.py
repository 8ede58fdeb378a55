"""Dependencies point one way: nothing below the HTTP layer imports `rp_service.api`.

Read from the source (ast), not by importing: a lazy import inside a function counts too.
`rp_service/app.py` is the one module above the routes (it includes them); `__main__`
starts it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import rp_service

ROOT = Path(rp_service.__file__).parent
_ABOVE_API = {ROOT / "app.py"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, source: str | None = None) -> set[str]:
    """Every module `path` (or `source` as if it were at `path`) imports, absolute,
    relative ones resolved."""
    text = path.read_text() if source is None else source
    tree = ast.parse(text, filename=str(path))
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.add(module)
            # `from rp_service import api` names the package in the alias
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _imports_api(name: str) -> bool:
    return name == "rp_service.api" or name.startswith("rp_service.api.")


def test_nothing_below_the_routes_imports_the_api_package() -> None:
    offenders = {}
    for path in sorted(ROOT.rglob("*.py")):
        if (ROOT / "api") in path.parents or path in _ABOVE_API:
            continue
        bad = sorted(name for name in _imports(path) if _imports_api(name))
        if bad:
            offenders[str(path.relative_to(ROOT.parent))] = bad
    assert offenders == {}, f"modules below rp_service/api import it: {offenders}"


def test_the_walk_sees_every_form_of_import() -> None:
    # The detector itself: each form below must be caught (a walk that missed one would
    # pass the test above for the wrong reason).
    as_path = ROOT / "jobs" / "probe.py"  # read as a module of rp_service.jobs; not written
    forms = [
        "import rp_service.api.deps",
        "from rp_service.api.deps import Services",
        "from rp_service import api",
        "def f():\n    from rp_service.api import openai\n",
        "from ..api import deps",
        "from .. import api",
    ]
    for source in forms:
        assert any(_imports_api(n) for n in _imports(as_path, source)), source
    assert not any(_imports_api(n) for n in _imports(as_path, "import rp_service.apis"))
    assert not any(_imports_api(n) for n in _imports(as_path, "from .openai_store import api"))
