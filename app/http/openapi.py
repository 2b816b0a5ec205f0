"""/openapi.json: FastAPI's document, completed with what it cannot infer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from starlette.routing import BaseRoute

from app.http.edge import NODE_HEADER_DESCRIPTIONS
from app.http.models import TxnRequest
from app.http.problems import Problem


def _hoist(model: type[BaseModel], components: dict[str, Any]) -> None:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema


def _drop_null_branch(parameter: dict[str, Any]) -> None:
    """An optional parameter is absent, never the string "null": document only its real type."""
    branches = parameter.get("schema", {}).get("anyOf")
    if not branches:
        return
    real = [branch for branch in branches if branch.get("type") != "null"]
    if len(real) == 1 and len(real) < len(branches):
        schema = {key: value for key, value in parameter["schema"].items() if key != "anyOf"}
        parameter["schema"] = {**real[0], **schema}


def complete_openapi(app: FastAPI, key_routes: Sequence[BaseRoute]) -> dict[str, Any]:
    """FastAPI's document plus what it cannot infer: the Problem and TxnRequest schemas
    referenced by hand, the node headers on every response, and without the default 422
    validation responses (parameter errors are 400 problem documents here), and without the
    null branch of optional parameters."""
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=[*key_routes, *app.routes])
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    _hoist(Problem, components)
    _hoist(TxnRequest, components)
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    node_headers = {name: {"description": text, "schema": {"type": "string"}} for name, text in NODE_HEADER_DESCRIPTIONS.items()}
    for path_item in schema.get("paths", {}).values():
        for operation in path_item.values():
            for parameter in operation.get("parameters", []):
                _drop_null_branch(parameter)
            responses: dict[str, Any] = operation.get("responses", {})
            default_422 = responses.get("422", {}).get("content", {}).get("application/json", {})
            if default_422.get("schema", {}).get("$ref", "").endswith("/HTTPValidationError"):
                del responses["422"]
            for status, response in responses.items():
                if operation is path_item.get("head") and status == "200":
                    response.pop("content", None)  # HEAD: the headers of GET, no body
                response.setdefault("headers", {}).update(node_headers)
    return schema
