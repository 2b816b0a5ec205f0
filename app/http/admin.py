"""The admin routes: take a snapshot, run the cleaner, and make the leader step down."""

from __future__ import annotations

from fastapi import APIRouter

from app.http.models import AdminResponse
from app.http.problems import problem_content, problem_responses
from app.service import CompactReport, KVService, ResignReport, SnapshotReport


def admin_router(service: KVService) -> APIRouter:
    router = APIRouter(tags=["admin"])
    admin_statuses = problem_responses(307, 503)

    snapshot_statuses = problem_responses(503)
    snapshot_statuses[503]["description"] = (
        "nothing applied yet, this replica is catching up, the node is shutting down, or the "
        "snapshot failed on an I/O error (detail); retry after Retry-After")
    snapshot_statuses[507] = {"description": "the disk holding the snapshots is full (detail names the error); "
                              "nothing was published; free space and retry", "content": problem_content()}

    @router.post("/v1/admin/snapshot", summary="Take a snapshot now",
                 response_model=AdminResponse, response_model_exclude_unset=True, responses=snapshot_statuses)
    async def admin_snapshot() -> SnapshotReport:
        return await service.take_snapshot()

    @router.post("/v1/admin/resign", summary="The leader steps down gracefully",
                 response_model=AdminResponse, response_model_exclude_unset=True, responses=admin_statuses)
    async def admin_resign() -> ResignReport:
        return await service.resign()

    compact = service.compact
    if compact is not None:  # a node that cannot compact has no such route (nor document)
        run_compact = compact

        @router.post("/v1/admin/compact", summary="Run the cleaner now (leader)",
                     response_model=AdminResponse, response_model_exclude_unset=True, responses=admin_statuses)
        async def admin_compact() -> CompactReport:
            return await run_compact()

    return router
