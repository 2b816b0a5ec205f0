"""The fast path of the key routes: GET, HEAD, PUT and DELETE /v1/kv/{key} as one small
ASGI app, reached from inside the one middleware stack (edge, auth) by ``KeyPathDispatch``.

Why not FastAPI routes: its per-request machinery (routing, dependency solving and
validation of every parameter) cost more CPU than everything else a write does on the
leader (docs/http.md). This app parses exactly what docs/api.md defines and calls the
``KeyEndpoints`` methods FastAPI documents in /openapi.json, with the same annotated types
validating each parameter, and maps exceptions through the same ``as_problem``.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, get_type_hints
from urllib.parse import parse_qsl

from fastapi import Request, params
from pydantic import TypeAdapter, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from app.http.keys import KeyEndpoints
from app.http.parsing import KEY_PATH_PREFIX, header, key_of_path
from app.http.problems import Answer, ProblemError, as_problem, invalid_parameters, problem_answer


@dataclass(frozen=True, slots=True)
class Parameter:
    """A query parameter or header of a key route, validated by the same annotated type
    FastAPI documents it with, so values, defaults and error messages are FastAPI's."""

    argument: str  # the endpoint's argument name
    location: Literal["query", "header"]
    wire_name: str  # query name, or header name as documented
    lookup: str | bytes  # query name, or lower-case header name
    adapter: TypeAdapter[Any]
    default: Any


def parameters_of(endpoint: Callable[..., Any]) -> tuple[Parameter, ...]:
    """The Query and Header arguments of an endpoint, from its signature."""
    hints = get_type_hints(endpoint, include_extras=True)
    parameters = []
    for name, parameter in inspect.signature(endpoint).parameters.items():
        info = next((m for m in getattr(hints.get(name), "__metadata__", ()) if isinstance(m, params.Query | params.Header)), None)
        if info is None:
            continue
        if isinstance(info, params.Header):
            wire_name = info.alias or name
            parameters.append(Parameter(name, "header", wire_name, wire_name.lower().encode("latin-1"),
                                         TypeAdapter(hints[name]), parameter.default))
        else:
            parameters.append(Parameter(name, "query", name, name, TypeAdapter(hints[name]), parameter.default))
    return tuple(parameters)


def parse_parameters(parameters: tuple[Parameter, ...], scope: Scope) -> dict[str, Any]:
    """Arguments from the query string and headers; every invalid one is listed in one 400,
    queries before headers, as FastAPI reports them. Absent: the default, unvalidated."""
    query_string: bytes = scope.get("query_string", b"")
    # As Starlette's QueryParams: latin-1, blank values kept, the last of repeated names wins.
    query = dict(parse_qsl(query_string.decode("latin-1"), keep_blank_values=True)) if query_string else {}
    arguments: dict[str, Any] = {}
    errors: list[dict[str, str]] = []
    for parameter in parameters:
        if parameter.location == "query":
            raw = query.get(str(parameter.lookup))
        else:
            raw = header(scope, bytes(parameter.lookup))  # type: ignore[arg-type]
        if raw is None:
            arguments[parameter.argument] = parameter.default
            continue
        try:
            arguments[parameter.argument] = parameter.adapter.validate_python(raw)
        except ValidationError as exc:
            errors.extend({"location": ".".join([parameter.location, parameter.wire_name, *map(str, error["loc"])]),
                           "message": str(error.get("msg", ""))} for error in exc.errors())
    if errors:
        raise invalid_parameters(errors)
    return arguments


class KeyRoutes:
    """GET, HEAD, PUT and DELETE /v1/kv/{key}: the hot routes, as one small ASGI app."""

    def __init__(self, endpoints: KeyEndpoints) -> None:
        read, write = parameters_of(endpoints.get_key), parameters_of(endpoints.put_key)
        self.routes: dict[str, tuple[Callable[..., Awaitable[Answer]], tuple[Parameter, ...]]] = {
            "GET": (endpoints.get_key, read), "HEAD": (endpoints.get_key, read),
            "PUT": (endpoints.put_key, write), "DELETE": (endpoints.delete_key, parameters_of(endpoints.delete_key)),
        }
        self.allow = ", ".join(sorted(self.routes))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope["method"]
        try:
            route = self.routes.get(method)
            if route is None:
                raise ProblemError(405, "method-not-allowed", "Method not allowed", "Method Not Allowed",
                                   headers={"Allow": self.allow})
            endpoint, parameters = route
            arguments = parse_parameters(parameters, scope)
            answer = await endpoint(Request(scope, receive), key_of_path(scope["path"], scope.get("raw_path")),
                                    **arguments)
        except Exception as exc:
            problem = as_problem(exc, scope)
            if problem is None:
                raise  # the edge logs it and answers 500
            answer = problem_answer(problem, method == "HEAD")
        await answer.send(send)


class KeyPathDispatch:
    """The innermost middleware of the stack: every path under /v1/kv/ goes to the key
    routes, everything else on to FastAPI's exception handling and router."""

    def __init__(self, app: ASGIApp, key_routes: ASGIApp) -> None:
        self.app = app
        self.key_routes = key_routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(KEY_PATH_PREFIX):
            await self.key_routes(scope, receive, send)
            return
        await self.app(scope, receive, send)
