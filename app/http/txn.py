"""POST /v1/txn: atomic compare-and-apply over several keys, one log record either way."""

from __future__ import annotations

import base64

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from app.http.models import (
    KEY_TOO_LARGE_ERROR,
    CompareExists,
    CompareModVersion,
    CompareValue,
    CompareValueBase64,
    DeleteOp,
    GetOp,
    PutBase64Op,
    PutOp,
    TxnCompare,
    TxnRequest,
    TxnResponse,
    utf8_bytes,
)
from app.http.parsing import read_body_bounded
from app.http.problems import ProblemError, describe, problem_responses, validation_errors
from app.http.render import render_op_result
from app.http.settings import HttpSettings
from app.service import Compare, CompareKind, KVService, Op, OpKind, is_internal_key


def _txn_value(item: PutOp | PutBase64Op | CompareValue | CompareValueBase64) -> bytes:
    if item.encoding == "base64":
        return base64.b64decode(item.value, validate=True)
    return utf8_bytes(item.value)


def txn_parts(body: TxnRequest, max_value_bytes: int) -> tuple[tuple[Compare, ...], tuple[Op, ...], tuple[Op, ...]]:
    """The body as ``KVService.txn``'s compares, success and failure ops."""

    def op(item: PutOp | PutBase64Op | DeleteOp | GetOp) -> Op:
        if isinstance(item, PutOp | PutBase64Op):
            value = _txn_value(item)
            if len(value) > max_value_bytes:
                raise ProblemError(413, "value-too-large", "Value too large",
                                   f"the value for {item.key!r} is {len(value)} bytes; at most {max_value_bytes} are allowed")
            return Op(OpKind.PUT, item.key, value, item.content_type, lease=item.lease)
        return Op(OpKind.DELETE if isinstance(item, DeleteOp) else OpKind.GET, item.key)

    def compare(item: TxnCompare) -> Compare:
        if isinstance(item, CompareModVersion):
            return Compare(item.key, CompareKind.MOD_VERSION, item.mod_version)
        if isinstance(item, CompareExists):
            return Compare(item.key, CompareKind.EXISTS, item.exists)
        return Compare(item.key, CompareKind.VALUE, _txn_value(item))

    return (tuple(compare(c) for c in body.compare), tuple(op(o) for o in body.success),
            tuple(op(o) for o in body.failure))


def txn_router(service: KVService, settings: HttpSettings) -> APIRouter:
    router = APIRouter(tags=["keys"])

    @router.post("/v1/txn", summary="Atomic compare-and-apply over several keys",
                 response_model=TxnResponse, responses=problem_responses(307, 400, 404, 413, 422, 503, 504, 507),
                 openapi_extra={"requestBody": {"required": True, "content": {
                     "application/json": {"schema": {"$ref": "#/components/schemas/TxnRequest"}}}}})
    async def txn(request: Request) -> Response:
        raw = await read_body_bounded(request, settings.max_txn_body_bytes, "the txn body", "body-too-large")
        try:
            body = TxnRequest.model_validate_json(raw)
        except ValidationError as exc:
            errors = validation_errors(exc)
            too_large = [error for error, raw_error in zip(errors, exc.errors(), strict=True)
                         if raw_error["type"] == KEY_TOO_LARGE_ERROR]
            if too_large:  # as the key routes answer for the same key
                raise ProblemError(413, "key-too-large", "Key too large", describe(too_large[0]),
                                   errors=too_large) from exc
            detail = "; ".join(describe(e) for e in errors[:10]) or "invalid txn body"
            raise ProblemError(422, "invalid-body", "Invalid txn body", detail, errors=errors) from exc
        compares, success, failure = txn_parts(body, settings.max_value_bytes)
        result = await service.txn(compares, success, failure)
        return JSONResponse({
            "succeeded": bool(result.succeeded), "version": result.version,
            # (a put with a lease also touched the lease's internal key: not the client's op)
            "results": [render_op_result(op) for op in result.ops if not is_internal_key(op.key)],
            "failed_compares": [{"key": key, "current_version": current} for key, current in result.failed_compares],
        })

    return router
