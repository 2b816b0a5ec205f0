"""The voter routes (KIP-853, docs/http.md "Voters"): add an observer as a voter, remove a
voter. Both are the leader's (others answer 307 to it) and need admin rights when auth is
on (every /v1/admin path does); each answers the new set once its voters record is
committed. The set in force is in /v1/status and /v1/quorum (app/http/cluster.py)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.http.models import JsonInteger, VoterSetResponse
from app.http.parsing import read_body_bounded
from app.http.problems import ProblemError, describe, problem_responses, validation_errors
from app.service import KVService, NewVoter, VoterSetView

VOTER_BODY_MAX_BYTES = 4096
MAX_NODE_ID = 2**31 - 1  # as --node-id allows
DIRECTORY_ID_PATTERN = r"^[0-9a-f]{32}$"
# HOST:PORT or [IPV6]:PORT, as --listen-raft takes it (the node re-checks the port range).
RAFT_ENDPOINT_PATTERN = r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._~-]+):[0-9]{1,5}$"
DirectoryId = Annotated[str, Field(pattern=DIRECTORY_ID_PATTERN, description="32 lowercase hex digits "
                                   "(the replica's data directory, identity.json)")]


class AddVoterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: JsonInteger = Field(ge=0, le=MAX_NODE_ID, description="the node id of an observer that has caught up")
    directory_id: DirectoryId | None = Field(None, description="default: the one its Fetches name")
    raft_endpoint: str | None = Field(None, pattern=RAFT_ENDPOINT_PATTERN, max_length=300,
                                      description="HOST:PORT the voters reach its raft port at (default: the one a "
                                                  "voters record or --voters named; else required)")
    http_url: str | None = Field(None, pattern=r"^https?://[^\s]+$", max_length=2048,
                                 description="its advertised HTTP URL (default: the one its Fetches name)")


NodeIdPath = Annotated[int, Path(ge=0, le=MAX_NODE_ID, description="the voter's node id")]


async def _add_request(request: Request) -> AddVoterRequest:
    raw = await read_body_bounded(request, VOTER_BODY_MAX_BYTES, "the voter body", "body-too-large")
    try:
        return AddVoterRequest.model_validate_json(raw)
    except ValidationError as exc:
        errors = validation_errors(exc)
        raise ProblemError(422, "invalid-body", "Invalid voter body",
                           "; ".join(describe(e) for e in errors[:10]) or "invalid body", errors=errors) from exc


_DESCRIPTIONS = {
    400: "invalid node id or directory id",
    404: "unknown-voter: no such voter (with that directory id); nothing changed",
    409: "refused, nothing changed: change-pending, already-voter, kraft-version-0 (a --voters cluster), "
         "not-caught-up or last-voter (the problem's type names it)",
    422: "the body is not JSON of the documented schema, or raft-endpoint-unknown (pass raft_endpoint)",
    503: "leader-not-ready (no entry of its epoch committed yet) or no leader; retry after Retry-After",
    504: "voter-change-indeterminate: the record was not seen committed; look at the set before retrying",
}


def _statuses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    responses = problem_responses(*statuses)
    for status, entry in responses.items():
        entry["description"] = _DESCRIPTIONS.get(int(status), entry["description"])
    return responses


def voters_router(service: KVService) -> APIRouter:
    router = APIRouter(tags=["admin"])
    body_schema: dict[str, Any] = AddVoterRequest.model_json_schema()

    @router.post("/v1/admin/voters", summary="Add an observer that caught up as a voter (leader)",
                 response_model=VoterSetResponse, responses=_statuses(307, 400, 409, 413, 422, 503, 504),
                 openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": body_schema}}}})
    async def add_voter(request: Request) -> VoterSetView:
        body = await _add_request(request)
        return await service.add_voter(NewVoter(body.id, body.directory_id, body.raft_endpoint, body.http_url))

    @router.delete("/v1/admin/voters/{node_id}", summary="Remove a voter (leader; the leader too: it then resigns)",
                   response_model=VoterSetResponse, responses=_statuses(307, 400, 404, 409, 503, 504))
    async def remove_voter(node_id: NodeIdPath, directory_id: Annotated[
            str | None, Query(pattern=DIRECTORY_ID_PATTERN, description="only while the voter is this replica")] = None,
    ) -> VoterSetView:
        return await service.remove_voter(node_id, directory_id)

    return router
