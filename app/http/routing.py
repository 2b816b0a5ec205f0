"""Route registration the routers share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from starlette.types import Scope


def add_get_and_head(router: APIRouter, path: str, endpoint: Callable[..., Any], *, summary: str,
                     **options: Any) -> None:
    """A GET route and its HEAD twin (same endpoint and options, so the same status and
    headers; the edge drops the body): load balancers and probes send HEAD. Two routes, not
    methods=["GET", "HEAD"], so /openapi.json gets two operation ids."""
    router.add_api_route(path, endpoint, methods=["GET"], summary=summary, **options)
    router.add_api_route(path, endpoint, methods=["HEAD"], name=f"head_{endpoint.__name__}",
                         summary=f"{summary}: the headers of GET, no body", **options)


def downgrades_scheme(scope: Scope, target_url: str) -> bool:
    """Whether a redirect to ``target_url`` would send an https client to plain http, where
    its bearer token and data would cross the network in the clear: never redirect there."""
    return scope.get("scheme") == "https" and not target_url.lower().startswith("https://")
