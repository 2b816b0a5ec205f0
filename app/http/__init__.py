"""metakv's HTTP face: FastAPI routers that translate docs/api.md to ``KVService`` calls.

Routes are thin on purpose: they parse and bound the request, call the service (which owns
every protocol decision: leadership, readiness, commit), and map results and exceptions to
statuses. Everything a fuzzer can reach is declared in the OpenAPI document, including every
problem status, so that ``/openapi.json`` is a complete description of the behaviour.

One module per concern: ``app`` assembles the application from ``settings`` (the bounds);
the routers are ``keys`` (with its fast path ``key_fast_path``), ``txn``, ``watch``,
``cluster`` and ``admin``, registered through ``routing``; ``parsing`` reads keys, headers
and bodies the same way everywhere, ``conditions`` turns If-Match and If-None-Match into
compares, ``render`` turns results into JSON members, ``models`` holds the bodies,
``problems`` the error documents, ``edge`` and ``auth`` the middleware, ``openapi`` the
document, and ``uvicorn_protocol`` the server protocol ``metakv serve`` runs.
"""

from app.http.app import MetakvApp, create_app
from app.http.settings import HttpSettings

__all__ = ["HttpSettings", "MetakvApp", "create_app"]
