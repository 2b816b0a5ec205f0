"""``create_app``: the FastAPI application of a node, assembled from the routers of
app/http/ behind one middleware stack.

The stack, outermost first: the edge (node headers, request metrics, the last-resort 500),
auth when a token file is configured, then the dispatch that sends every path under
/v1/kv/ to the key routes' fast path and everything else to FastAPI (its own error
handling, then its router). Both routers pass the same edge and auth, installed once.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from app.http.admin import admin_router
from app.http.audit import AuditLog
from app.http.auth import AuthMiddleware, add_security_scheme, auth_open_paths, document_auth
from app.http.cluster import cluster_router
from app.http.edge import EdgeMiddleware
from app.http.key_fast_path import KeyPathDispatch, KeyRoutes
from app.http.keys import KeyEndpoints, key_documentation_router, list_router
from app.http.leases import leases_router
from app.http.openapi import complete_openapi
from app.http.problems import install_problem_handlers
from app.http.settings import HttpSettings
from app.http.snapshot_download import snapshot_download_router
from app.http.txn import txn_router
from app.http.voters import voters_router
from app.http.watch import watch_router
from app.service import KVService
from app.ui.data_routes import data_router
from app.ui.modes import UiMode
from app.ui.pages import UiPathDispatch, page_routes


class MetakvApp(FastAPI):
    """FastAPI behind the middleware stack ``create_app`` assembles (see the module docstring)."""

    stack: ASGIApp | None = None

    def add_middleware(self, middleware_class: Any, *args: Any, **kwargs: Any) -> None:
        """Refused once the stack is assembled: FastAPI middleware would sit inside it, behind
        the key routes' dispatch, and never see /v1/kv/ requests (auth would silently not
        apply to them). Wrap the app instead: ``app = SomeMiddleware(create_app(service))``."""
        if self.stack is not None:
            raise RuntimeError("MetakvApp serves /v1/kv/ ahead of FastAPI's middleware stack: "
                               "wrap the ASGI app create_app returns instead of add_middleware")
        super().add_middleware(middleware_class, *args, **kwargs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.stack is None:
            await super().__call__(scope, receive, send)
            return
        await self.stack(scope, receive, send)

    async def serve_routes(self, scope: Scope, receive: Receive, send: Send) -> None:
        """FastAPI itself: the innermost layer of the stack."""
        await super().__call__(scope, receive, send)


def create_app(service: KVService, settings: HttpSettings | None = None, ui: UiMode = "on") -> MetakvApp:
    """The application serving ``service`` per docs/api.md. Without ``settings``, the
    defaults, bounding values by the service's ``max_value_bytes``; request metrics go to
    ``service.metrics``, and ``service.auth_tokens`` (when set) is enforced. ``ui``: the
    dashboard at /ui (docs/ui.md)."""
    settings = settings or HttpSettings(max_value_bytes=service.max_value_bytes)
    # No slash redirects: Starlette would answer /v1/status/ with a bare 307 to /v1/status on
    # this very node (no body, no problem document), which a client reads as "not the leader".
    app = MetakvApp(title="metakv", version="1", description="Replicated key-value metadata store (docs/api.md).",
                    redirect_slashes=False)
    install_problem_handlers(app)
    key_endpoints = KeyEndpoints(service, settings)
    # Never served: it only feeds /openapi.json (the fast path serves these routes).
    key_documentation = key_documentation_router(key_endpoints)
    audit = AuditLog()  # one rate limit for auth's refusals, the lease routes' and the edge's admin actions
    routers = [list_router(service, settings), txn_router(service, settings), watch_router(service, settings),
               cluster_router(service), admin_router(service), snapshot_download_router(service),
               leases_router(service, audit), voters_router(service)]
    if ui != "off":
        routers.append(data_router(service, ui))
    for router in routers:
        # Flat, not include_router: FastAPI keeps an included router as one nested route,
        # which hides its routes from the 405 answer's Allow header, the metrics' route
        # label and auth's documentation (they walk app.router.routes).
        app.router.routes.extend(router.routes)

    tokens = service.auth_tokens
    open_paths = auth_open_paths(app)
    if tokens is not None:
        document_auth([*key_documentation.routes, *app.routes], open_paths)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = complete_openapi(app, key_documentation.routes)
            if tokens is not None:
                add_security_scheme(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    key_routes = KeyPathDispatch(app.serve_routes, KeyRoutes(key_endpoints))
    with_auth = key_routes if tokens is None else AuthMiddleware(
        key_routes, tokens, settings.max_txn_body_bytes, open_paths, audit)
    if ui == "off":
        app.stack = EdgeMiddleware(with_auth, service, app.router.routes, audit)
        return app
    # The pages go ahead of auth (a browser following a link sends no token); what they
    # show, their scripts read through the API with the user's token.
    pages = page_routes(service, ui)
    app.stack = EdgeMiddleware(UiPathDispatch(with_auth, pages), service, [*app.router.routes, *pages.routes], audit)
    return app
