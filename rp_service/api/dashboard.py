"""The web dashboard: `/` and its static assets under `/ui/` (package data in rp_service/web).

The assets hold no data, so they are served without the bearer token; the page then calls
the public REST API with the token the user typed (kept in the tab's sessionStorage).
Only files that exist in the web directory when the daemon starts are served, by name.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, RedirectResponse

from rp_service.errors import NotFound

__all__ = ["ASSET_PREFIX", "is_public_path", "router"]

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
ASSET_PREFIX = "/ui/"
_MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".txt": "text/plain; charset=utf-8",
}
# No inline script or style and no other origin: a token typed into the page can only go
# back to this daemon. `blob:` is for checkpoint downloads made with fetch().
_SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


def _asset_index(root: Path) -> dict[str, Path]:
    """Relative name -> file, for every servable file under `root` (no dotfiles)."""
    return {
        p.relative_to(root).as_posix(): p
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.suffix in _MEDIA_TYPES and not p.name.startswith(".")
    }


_ASSETS = _asset_index(WEB_DIR)


def is_public_path(path: str) -> bool:
    """Routes the bearer-token guard lets through: liveness, the page and its assets, and
    /docs (a redirect to the page's API view, which reads the schema with the token)."""
    return path in ("/healthz", "/", "/docs") or path.startswith(ASSET_PREFIX)


router = APIRouter(include_in_schema=False)


def _file(path: Path) -> FileResponse:
    return FileResponse(path, media_type=_MEDIA_TYPES[path.suffix], headers=_SECURITY_HEADERS)


@router.get("/")
async def index() -> FileResponse:
    """The dashboard's single page; the hash (#/jobs, #/jobs/ID, ...) picks the view."""
    return _file(_ASSETS["index.html"])


@router.get("/docs")
async def api_reference() -> RedirectResponse:
    """The API reference: the dashboard's view of /openapi.json (served from here, so it
    works offline, and asking for the token like every page; Swagger UI came from a CDN
    and answered a browser with a 401)."""
    return RedirectResponse("/#/api", status_code=307)


@router.get(ASSET_PREFIX + "{name:path}")
async def asset(name: str) -> FileResponse:
    path = _ASSETS.get(name)
    if path is None:
        raise NotFound(f"no dashboard asset {name!r}", code="not_found")
    return _file(path)
