"""The dashboard's own JSON routes under /ui/api/: the cluster snapshot, the plots' points,
and what the caller's token may do. They sit behind auth like /v1/status (any valid token),
are left out of /openapi.json (they are the dashboard's, not the API's contract), and never
return keys or values: those the pages read through the public API with the user's token.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from app.auth import Access
from app.service import KVService
from app.ui.cluster_view import ClusterView
from app.ui.metrics_history import MetricsHistory
from app.ui.modes import UiMode


def data_router(service: KVService, mode: UiMode) -> APIRouter:
    router = APIRouter(include_in_schema=False)
    cluster_view = ClusterView(service)
    history = MetricsHistory(service.metrics)

    # Bytes encoded once and shared by every tab: many open dashboards must not load the
    # node they watch. Pages poll these rather than hold a stream: a browser opens at most
    # six HTTP/1.1 connections to one host, so streaming tabs would starve every other tab.
    @router.get("/ui/api/cluster")
    async def cluster(request: Request) -> Response:
        return Response(await cluster_view.snapshot(request.headers.get("authorization")),
                        media_type="application/json")

    @router.get("/ui/api/metrics")
    async def metrics() -> Response:
        return Response(history.encoded(service.node_id), media_type="application/json")

    @router.get("/ui/api/access")
    async def access(request: Request, key: Annotated[str, Query(max_length=4096)] = "") -> dict[str, Any]:
        """Whether to offer edit controls for ``key`` (a key, or a prefix new keys go under):
        never in read-only mode, else when the token may write it. The API decides anyway."""
        level = token_access(service, request.headers.get("authorization"), key)
        return {"mode": mode, "read": level >= Access.READ, "write": mode == "on" and level >= Access.WRITE}

    return router


def token_access(service: KVService, authorization: str | None, key: str) -> Access:
    """The access the bearer token in ``authorization`` has to ``key``; everything when auth
    is off. (Auth let the request through, so a token is present and valid when it is on.)"""
    tokens = service.auth_tokens
    if tokens is None:
        return Access.ADMIN
    scheme, _, secret = (authorization or "").strip().partition(" ")
    token = tokens.policy.authenticate(secret.strip().encode()) if scheme.lower() == "bearer" else None
    return Access.DENY if token is None else token.access_to_key(key)
