"""The lease routes: grant, keep-alive (one lease or a batch), revoke, info and list
(docs/http.md "Leases", docs/leases.md). Every call but the list is the leader's: others
answer 307 to it, as writes do. With auth on, any lease call needs write on some key
(app/http/auth.py); a revoke also needs write on every key it deletes and a lease's key
list read on every key it shows, as etcd checks (the same rules as the key routes)."""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.auth import Access
from app.http.audit import AuditLog
from app.http.auth import token_name
from app.http.models import JsonInteger, PositiveLeaseId
from app.http.parsing import read_body_bounded
from app.http.problems import ProblemError, describe, problem_responses, validation_errors
from app.service import MAX_LEASE_ID, KeysCheck, KVService

MAX_KEEPALIVE_IDS = 10_000
# A batch of MAX_KEEPALIVE_IDS ids of 19 digits with separators, with room to spare.
LEASE_BODY_MAX_BYTES = 512 * 1024
BodyModel = TypeVar("BodyModel", bound=BaseModel)
LeaseIdPath = Annotated[int, Path(ge=1, le=MAX_LEASE_ID, description="the lease id")]


class GrantRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Bounds checked by the service (400 invalid-ttl), documented per node (leases_router).
    ttl_s: JsonInteger = Field(description="seconds without a keep-alive before the lease ends; at least 1 and "
                               "at most the node's --max-lease-ttl-s (a TTL below the minimum is raised to it)")
    id: PositiveLeaseId | None = Field(None, description="the id to grant (default: one is chosen)")


class KeepAliveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ids: list[PositiveLeaseId] = Field(max_length=MAX_KEEPALIVE_IDS, description="the leases to keep alive")


class LeaseTtl(BaseModel):
    id: int
    ttl_s: int


class GrantResponse(LeaseTtl):
    version: int = Field(description="the version that granted the lease")


class KeepAliveBatchResponse(BaseModel):
    leases: list[LeaseTtl] = Field(description="the leases whose countdown restarted from ttl_s")
    not_found: list[int] = Field(description="ids of leases that do not exist (or are past their deadline)")


class RevokeResponse(BaseModel):
    id: int
    version: int = Field(description="the version that deleted the lease and every attached key")
    deleted_keys: int


class LeaseInfoResponse(LeaseTtl):
    remaining_s: float = Field(description="seconds until the leader ends the lease without a keep-alive")
    granted_version: int
    keys: list[str] | None = Field(None, description="the attached keys (with keys=true)")


class LeaseListResponse(BaseModel):
    leases: list[LeaseTtl]
    version: int


async def _read_body(request: Request, model: type[BodyModel]) -> BodyModel:
    """The body, bounded, as ``model``: 422 invalid-body for anything else."""
    raw = await read_body_bounded(request, LEASE_BODY_MAX_BYTES, "the lease body", "body-too-large")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = validation_errors(exc)
        detail = "; ".join(describe(e) for e in errors[:10]) or "invalid body"
        raise ProblemError(422, "invalid-body", "Invalid lease body", detail, errors=errors) from exc


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def grant_schema(max_ttl_s: int) -> dict[str, Any]:
    """GrantRequest's schema with this node's TTL bounds (they are configuration)."""
    schema = GrantRequest.model_json_schema()
    schema["properties"]["ttl_s"].update(minimum=1, maximum=max_ttl_s)
    return schema


def keys_check(service: KVService, audit: AuditLog, request: Request, access: Access) -> KeysCheck | None:
    """With auth on, a check that the request's token has ``access`` to each key of a lease:
    else 403, written to the audit log like auth's own refusals."""
    tokens, name = service.auth_tokens, token_name(request.scope)
    if tokens is None or name is None:
        return None
    token = next((token for token in tokens.policy.tokens if token.name == name), None)
    verb = access.name.lower()

    def check(keys: list[str]) -> None:
        refused = next((key for key in keys if token is None or token.access_to_key(key) < access), None)
        if refused is not None:
            detail = f"token {name!r} lacks {verb} access to the key {refused!r}, attached to the lease"
            audit.denied(request.scope, 403, detail, name)
            raise ProblemError(403, "forbidden", "Forbidden", detail)
    return check


def leases_router(service: KVService, audit: AuditLog | None = None) -> APIRouter:
    # {lease_id:int}: only digits reach these routes, so /v1/leases/keepalive is the batch
    # route's alone (a 405's Allow names its methods only); other ids answer 404.
    router = APIRouter(tags=["leases"])
    audit = audit or AuditLog()
    leader_statuses = problem_responses(307, 400, 404, 503, 504)

    def checks(request: Request, access: Access) -> KeysCheck | None:
        return keys_check(service, audit, request, access)


    @router.post("/v1/leases", status_code=201, summary="Grant a lease", response_model=GrantResponse,
                 responses={**problem_responses(307, 400, 409, 413, 422, 503, 504, 507)},
                 openapi_extra=_body(grant_schema(service.max_lease_ttl_s)))
    async def grant(request: Request) -> Response:
        body = await _read_body(request, GrantRequest)
        granted = await service.grant_lease(body.ttl_s, body.id)
        return JSONResponse({"id": granted.id, "ttl_s": granted.ttl_s, "version": granted.version}, status_code=201)

    @router.post("/v1/leases/keepalive", summary="Keep many leases alive (one leadership confirmation)",
                 response_model=KeepAliveBatchResponse, responses=problem_responses(307, 400, 413, 422, 503, 504),
                 openapi_extra=_body(KeepAliveRequest.model_json_schema()))
    async def keep_alive_batch(request: Request) -> Response:
        body = await _read_body(request, KeepAliveRequest)
        report = await service.keep_alive_leases(body.ids)
        return JSONResponse({"leases": [{"id": lease_id, "ttl_s": ttl_s} for lease_id, ttl_s in report.kept],
                             "not_found": report.not_found})

    @router.post("/v1/leases/{lease_id:int}/keepalive", summary="Keep a lease alive", response_model=LeaseTtl,
                 responses=leader_statuses)
    async def keep_alive(lease_id: LeaseIdPath) -> Response:
        report = await service.keep_alive_leases([lease_id])
        if not report.kept:
            raise ProblemError(404, "lease-not-found", "Lease not found",
                               f"lease {lease_id} does not exist (never granted, revoked or expired)", lease=lease_id)
        kept_id, ttl_s = report.kept[0]
        return JSONResponse({"id": kept_id, "ttl_s": ttl_s})

    @router.delete("/v1/leases/{lease_id:int}", summary="Revoke a lease: it and every attached key go in one version",
                   response_model=RevokeResponse, responses=leader_statuses)
    async def revoke(request: Request, lease_id: LeaseIdPath) -> Response:
        revoked = await service.revoke_lease(lease_id, checks(request, Access.WRITE))
        return JSONResponse({"id": revoked.id, "version": revoked.version, "deleted_keys": revoked.deleted_keys})

    @router.get("/v1/leases/{lease_id:int}", summary="A lease's TTL, remaining time and keys (the leader's view)",
                response_model=LeaseInfoResponse, response_model_exclude_none=True, responses=leader_statuses)
    async def info(request: Request, lease_id: LeaseIdPath,
                   keys: Annotated[bool, Query(description="list the attached keys")] = False) -> Response:
        lease = await service.lease_info(lease_id, keys, checks(request, Access.READ))
        document: dict[str, Any] = {"id": lease.id, "ttl_s": lease.ttl_s, "remaining_s": round(lease.remaining_s, 3),
                                    "granted_version": lease.granted_version}
        if lease.keys is not None:
            document["keys"] = lease.keys
        return JSONResponse(document)

    @router.get("/v1/leases", summary="Every lease (any node, from its applied state)", response_model=LeaseListResponse,
                responses=problem_responses(503))
    async def list_leases() -> Response:
        page = service.list_leases()
        return JSONResponse({"leases": [{"id": lease_id, "ttl_s": ttl_s} for lease_id, ttl_s in page.leases],
                             "version": page.version})

    return router
