"""The dashboard's pages and assets: server-rendered Jinja2 shells, open without a token.

A page holds no key, value or cluster fact: a browser cannot send a bearer token when it
follows a link, so the pages are open like /healthz, and their scripts read everything
through the public API (or /ui/api/, behind auth) with the token the user typed, kept in
the tab's sessionStorage. What a page does render (the prefix or key from its URL) is
escaped by Jinja2's autoescape. Every answer carries a strict Content-Security-Policy: no
inline script or style, no other origin to connect to, so the token can only go back to
the node that served the page.
"""

from __future__ import annotations

import hashlib
import mimetypes
from pathlib import Path
from typing import Any
from urllib.parse import unquote_to_bytes

import jinja2
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Match, Route, Router
from starlette.types import ASGIApp, Receive, Scope, Send

from app.http.problems import PROBLEM_MEDIA_TYPE, problem_body
from app.service import KVService
from app.ui.modes import UiMode

PACKAGE_DIR = Path(__file__).resolve().parent
UI_PATH = "/ui"
DATA_PATH_PREFIX = "/ui/api/"  # the dashboard's JSON routes: behind auth, not served here
KEY_PAGE_PREFIX = "/ui/keys/"
# Typed with a trailing slash, these mean the page without it (/ui/keys/ is no key's page).
SLASHED_PAGES = frozenset({UI_PATH + "/", "/ui/keys/", "/ui/watch/", "/ui/leases/"})
SECURITY_HEADERS = [
    (b"content-security-policy",
     b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
     b"base-uri 'none'; form-action 'self'; frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
]


class StaticAssets:
    """Every file under static/, read once: only these names are ever served."""

    def __init__(self, directory: Path) -> None:
        self.files: dict[str, tuple[bytes, str, str]] = {}
        for path in sorted(directory.iterdir()):
            if path.is_file():
                body = path.read_bytes()
                media_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
                self.files[path.name] = (body, media_type, hashlib.sha256(body).hexdigest()[:16])

    def version(self, name: str) -> str:
        """A content hash for the asset's URL, so a cached copy is never stale."""
        return self.files[name][2]

    async def serve(self, request: Request) -> Response:
        found = self.files.get(request.path_params["name"])
        if found is None:
            return problem(404, "not-found", "Not found", "no such dashboard asset")
        body, media_type, _ = found
        return Response(body, media_type=media_type, headers={"Cache-Control": "public, max-age=86400"})


def page_routes(service: KVService, mode: UiMode) -> Router:
    """The page and asset routes (mode "on" or "read-only")."""
    environment = jinja2.Environment(loader=jinja2.FileSystemLoader(PACKAGE_DIR / "templates"),
                                     autoescape=True, undefined=jinja2.StrictUndefined)
    assets = StaticAssets(PACKAGE_DIR / "static")

    def render(template: str, view: str, **context: Any) -> HTMLResponse:
        html = environment.get_template(template).render(
            view=view, node_id=service.node_id, mode=mode, auth=service.auth_tokens is not None,
            asset=lambda name: f"{UI_PATH}/static/{name}?v={assets.version(name)}", **context)
        return HTMLResponse(html, headers={"Cache-Control": "no-store"})

    async def cluster(request: Request) -> Response:
        return render("cluster.html", "cluster")

    async def keys(request: Request) -> Response:
        prefix = request.query_params.get("prefix", "")
        listing = "flat" if request.query_params.get("view") == "flat" else "tree"
        return render("keys.html", "keys", prefix=prefix, listing=listing,
                      after=request.query_params.get("after", ""), crumbs=breadcrumbs(prefix))

    async def key(request: Request) -> Response:
        try:
            name = key_of_page_path(request.scope)
        except ValueError as exc:
            return problem(400, "invalid-key", "Invalid key", str(exc))
        parent = name[:name.rstrip("/").rfind("/") + 1]
        return render("key.html", "keys", key=name, crumbs=breadcrumbs(parent))

    async def watch(request: Request) -> Response:
        return render("watch.html", "watch", prefix=request.query_params.get("prefix", ""))

    async def leases(request: Request) -> Response:
        return render("leases.html", "leases")

    return Router([
        Route(UI_PATH, cluster, methods=["GET"]),
        Route(f"{UI_PATH}/keys", keys, methods=["GET"]),
        Route(KEY_PAGE_PREFIX + "{key:path}", key, methods=["GET"]),
        Route(f"{UI_PATH}/watch", watch, methods=["GET"]),
        Route(f"{UI_PATH}/leases", leases, methods=["GET"]),
        Route(f"{UI_PATH}/static/{{name}}", assets.serve, methods=["GET"]),
    ])


def problem(status: int, slug: str, title: str, detail: str) -> Response:
    return Response(problem_body(status, slug, title, detail), status_code=status, media_type=PROBLEM_MEDIA_TYPE)


def breadcrumbs(prefix: str) -> list[tuple[str, str]]:
    """(label, prefix) for each "/"-separated level of ``prefix``, the root first."""
    crumbs = [("(root)", "")]
    start = 0
    while (end := prefix.find("/", start)) >= 0:
        crumbs.append((prefix[start:end + 1], prefix[:end + 1]))
        start = end + 1
    if start < len(prefix):
        crumbs.append((prefix[start:], prefix))
    return crumbs


def key_of_page_path(scope: Scope) -> str:
    """The key of a /ui/keys/{key} page, percent-decoded from the raw path as the key routes
    decode /v1/kv/{key}, so the page and the API always name the same key."""
    raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
    raw_key = unquote_to_bytes(raw_path.split(b"?", 1)[0][len(KEY_PAGE_PREFIX):])
    if not raw_key or b"\x00" in raw_key:
        raise ValueError("the key must not be empty or contain NUL")
    try:
        return raw_key.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("the key is not valid UTF-8") from None


class UiPathDispatch:
    """Serves the dashboard's pages and assets ahead of auth (they are open); every other
    request, /ui/api/ included, goes on to ``app``."""

    def __init__(self, app: ASGIApp, pages: Router) -> None:
        self.app = app
        self.pages = pages

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if (path == UI_PATH or path.startswith(UI_PATH + "/")) and not path.startswith(DATA_PATH_PREFIX):
            await self.page_or_problem(scope, receive, _with_security_headers(send))
            return
        if path.startswith(DATA_PATH_PREFIX):
            send = _with_security_headers(send)
        await self.app(scope, receive, send)

    async def page_or_problem(self, scope: Scope, receive: Receive, send: Send) -> None:
        matches = [route.matches(scope)[0] for route in self.pages.routes]
        answer = not_a_page(scope, matches)
        if answer is None:
            await self.pages(scope, receive, send)
        else:
            await answer(scope, receive, send)


def not_a_page(scope: Scope, matches: list[Match]) -> Response | None:
    """None for a page; else, ahead of auth (nothing under /ui but /ui/api/ holds data), an
    answer a person typing the URL can act on: the page without the trailing slash, or a
    problem document (not "send a token")."""
    if scope["path"] in SLASHED_PAGES and scope["method"] in ("GET", "HEAD"):
        query = scope.get("query_string", b"").decode("latin-1")
        return Response(status_code=308, headers={"Location": scope["path"].rstrip("/") + (f"?{query}" if query else "")})
    if Match.FULL in matches:
        return None
    if Match.PARTIAL in matches:
        return Response(problem_body(405, "method-not-allowed", "Method not allowed", "dashboard pages are only read"),
                        status_code=405, media_type=PROBLEM_MEDIA_TYPE, headers={"Allow": "GET, HEAD"})
    return problem(404, "not-found", "Not found", "no such dashboard page: see /ui")


def _with_security_headers(send: Send) -> Send:
    async def sending(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *SECURITY_HEADERS]}
        await send(message)
    return sending  # type: ignore[return-value]
