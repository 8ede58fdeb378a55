"""The dashboard's files: shipped in the wheel, linked correctly, served without the token."""

from __future__ import annotations

import fnmatch
import hashlib
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from rp_service.api.dashboard import WEB_DIR, is_public_path
from rp_service.app import create_app
from rp_service.settings import Settings

REPO = Path(__file__).resolve().parents[3]
JS_YAML_SHA256 = "de0f5266d4312ab9cd564aba4217eb9cc98dcfd18bd59988aa7e0971e7c722b5"
_IMPORT = re.compile(r"""(?:^|\n)\s*import\s[^;]*?from\s+"(\.{1,2}/[^"]+)";""")


def _web_files() -> list[Path]:
    return sorted(p for p in WEB_DIR.rglob("*") if p.is_file())


def test_every_dashboard_file_is_package_data() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["rp_service"]
    package = REPO / "rp_service"
    missing = [
        p.relative_to(package).as_posix()
        for p in _web_files()
        if not any(fnmatch.fnmatch(p.relative_to(package).as_posix(), pat) for pat in patterns)
    ]
    assert missing == [], "add these to [tool.setuptools.package-data] in pyproject.toml"


def test_module_imports_resolve_to_shipped_files() -> None:
    modules = [p for p in _web_files() if p.suffix == ".js"]
    assert len(modules) >= 8
    for module in modules:
        for target in _IMPORT.findall(module.read_text()):
            assert (module.parent / target).resolve().is_file(), f"{module.name}: {target}"


def test_page_has_no_inline_script_or_style() -> None:
    # The Content-Security-Policy allows only scripts and styles from the daemon itself.
    html = (WEB_DIR / "index.html").read_text()
    assert re.findall(r"<script\b[^>]*>", html) == ['<script type="module" src="/ui/app.js">']
    assert "<style" not in html and " style=" not in html
    assert not re.search(r"\son[a-z]+=", html)  # no inline event handlers either


def test_vendored_js_yaml_is_the_npm_file() -> None:
    data = (WEB_DIR / "vendor" / "js-yaml.min.mjs").read_bytes()
    assert hashlib.sha256(data).hexdigest() == JS_YAML_SHA256


@pytest.mark.parametrize(
    ("path", "public"),
    [
        ("/", True),
        ("/healthz", True),
        ("/ui/app.js", True),
        ("/ui", False),
        ("/uix/app.js", False),
        ("/readyz", False),
        ("/metrics", False),
        ("/v1/jobs", False),
        ("/docs", True),  # a redirect to the page's API view, no data
        ("/openapi.json", False),
    ],
)
def test_public_paths(path: str, public: bool) -> None:
    assert is_public_path(path) is public


@pytest.fixture
def anonymous(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(data_dir=tmp_path, gpus="none", token="tok")
    with TestClient(create_app(settings), base_url="http://127.0.0.1:8321") as c:
        yield c


def test_assets_are_served_without_the_token_and_the_api_still_needs_it(
    anonymous: TestClient,
) -> None:
    page = anonymous.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    for path in _web_files():
        name = path.relative_to(WEB_DIR).as_posix()
        if path.suffix in (".js", ".mjs", ".css", ".html"):
            r = anonymous.get(f"/ui/{name}")
            assert r.status_code == 200, name
            assert r.content == path.read_bytes()
    assert anonymous.get("/ui/app.js").headers["content-type"].startswith("text/javascript")
    missing = anonymous.get("/ui/nope.js")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert anonymous.get("/ui/..%2F..%2Fapp.py").status_code == 404
    for path in ("/v1/jobs", "/v1/system", "/readyz", "/metrics", "/openapi.json"):
        assert anonymous.get(path).status_code == 401, path
    assert "/" not in anonymous.app.openapi()["paths"]  # type: ignore[attr-defined]
