"""The cluster routes: this node's status, the leader's quorum view, the probes and the
Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.http.models import HealthResponse, QuorumResponse, ReadyResponse, StatusResponse
from app.http.problems import RETRY_AFTER_SECONDS, ProblemError, problem_responses
from app.http.routing import add_get_and_head
from app.service import KVService, NodeStatus, QuorumView


def cluster_router(service: KVService) -> APIRouter:
    router = APIRouter(tags=["cluster"])

    async def status() -> NodeStatus:
        return service.status()

    async def quorum() -> QuorumView:
        return service.quorum()

    async def healthz() -> HealthResponse:
        return HealthResponse(status="ok")

    async def readyz() -> ReadyResponse:
        if not service.is_ready():
            raise ProblemError(503, "not-ready", "Not ready", "this node cannot serve consistent reads yet",
                               headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        return ReadyResponse(ready=True)

    async def metrics() -> Response:
        return Response(generate_latest(service.metrics), headers={"content-type": CONTENT_TYPE_LATEST})

    add_get_and_head(router, "/v1/status", status, summary="This node's state", response_model=StatusResponse,
                     response_model_exclude_unset=True)
    add_get_and_head(router, "/v1/quorum", quorum, summary="The leader's view of the quorum",
                     response_model=QuorumResponse, response_model_exclude_unset=True,
                     responses=problem_responses(307, 503))
    add_get_and_head(router, "/healthz", healthz, summary="200 while the process serves", response_model=HealthResponse)
    add_get_and_head(router, "/readyz", readyz, summary="200 when this node can serve consistent reads",
                     response_model=ReadyResponse, responses=problem_responses(503))
    add_get_and_head(router, "/metrics", metrics, summary="Prometheus metrics", response_class=Response,
                     responses={200: {"description": "Prometheus text format",
                                      "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}})
    return router
