"""Every service exception's status, cluster and admin routes, metrics, and the OpenAPI document."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.middleware.gzip import GZipMiddleware

from app.http import HttpSettings, create_app
from app.service import (
    IndeterminateError,
    NotLeaderError,
    NotReadyError,
    VersionWaitTimeoutError,
    WriteRejectedError,
)
from tests.http.conftest import TEST_SETTINGS
from tests.http.service_double import InProcessService
from tests.http.test_keys import assert_node_headers, assert_problem

pytestmark = pytest.mark.anyio


class FaultyService(InProcessService):
    """The in-process node, but chosen calls raise what a real runtime raises under faults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.faults: dict[str, BaseException] = {}
        self.ready = True

    def _maybe_raise(self, call: str) -> None:
        if call in self.faults:
            raise self.faults[call]

    async def propose(self, command: Any) -> Any:
        self._maybe_raise("propose")
        return await super().propose(command)

    async def wait_readable(self, consistency: Any, min_version: int | None, wait_ms: int) -> None:
        self._maybe_raise("wait_readable")
        await super().wait_readable(consistency, min_version, wait_ms)

    def is_ready(self) -> bool:
        return self.ready

    def quorum(self) -> dict[str, Any]:
        self._maybe_raise("quorum")
        return super().quorum()

    async def resign(self) -> dict[str, Any]:
        self._maybe_raise("resign")
        return await super().resign()

    async def compact(self) -> dict[str, Any]:
        self._maybe_raise("compact")
        return {"dirty_offset": self.state.applied_version}


@pytest.fixture
def faulty(tmp_path: Path) -> FaultyService:
    node = FaultyService(str(tmp_path / "state.db"), str(tmp_path / "snapshots"))
    yield node
    node.close()


@pytest.fixture
async def faulty_client(faulty: FaultyService) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(faulty, TEST_SETTINGS))
    async with httpx.AsyncClient(transport=transport, base_url="http://node1") as http:
        yield http


async def test_not_leader_write_is_307_to_same_path_and_query_on_leader(faulty: FaultyService,
                                                                         faulty_client: httpx.AsyncClient) -> None:
    faulty.faults["propose"] = NotLeaderError("http://127.0.0.1:8002/", leader_id=2)
    response = await faulty_client.put("/v1/kv/a%20b/c?x=1&y=%2F", content=b"v")
    document = assert_problem(response, 307)
    assert response.headers["location"] == "http://127.0.0.1:8002/v1/kv/a%20b/c?x=1&y=%2F"
    assert document["leader"] == 2 and document["leader_url"] == "http://127.0.0.1:8002/"
    delete = await faulty_client.delete("/v1/kv/k")
    assert delete.status_code == 307 and delete.headers["location"] == "http://127.0.0.1:8002/v1/kv/k"
    txn = await faulty_client.post("/v1/txn", json={"success": []})
    assert txn.status_code == 307 and txn.headers["location"] == "http://127.0.0.1:8002/v1/txn"


async def test_leader_read_on_follower_is_307(faulty: FaultyService, faulty_client: httpx.AsyncClient) -> None:
    faulty.faults["wait_readable"] = NotLeaderError("http://leader:8001", leader_id=3)
    response = await faulty_client.get("/v1/kv/k", params={"consistency": "leader"})
    assert_problem(response, 307)
    assert response.headers["location"] == "http://leader:8001/v1/kv/k?consistency=leader"
    listed = await faulty_client.get("/v1/kv", params={"consistency": "linearizable", "prefix": "p"})
    assert listed.headers["location"] == "http://leader:8001/v1/kv?consistency=linearizable&prefix=p"


async def test_no_known_leader_is_503_with_retry_after(faulty: FaultyService, faulty_client: httpx.AsyncClient) -> None:
    faulty.faults["propose"] = NotLeaderError(None)
    response = await faulty_client.put("/v1/kv/k", content=b"v")
    assert_problem(response, 503)
    assert int(response.headers["retry-after"]) >= 1
    assert "location" not in response.headers


async def test_write_rejected_is_503(faulty: FaultyService, faulty_client: httpx.AsyncClient) -> None:
    faulty.faults["propose"] = WriteRejectedError("accumulator full")
    response = await faulty_client.put("/v1/kv/k", content=b"v")
    document = assert_problem(response, 503)
    assert "indeterminate" not in document
    assert "retry-after" in response.headers


async def test_indeterminate_write_is_504_indeterminate(faulty: FaultyService, faulty_client: httpx.AsyncClient) -> None:
    faulty.faults["propose"] = IndeterminateError("leadership lost mid-flight")
    for response in (await faulty_client.put("/v1/kv/k", content=b"v"), await faulty_client.delete("/v1/kv/k"),
                     await faulty_client.post("/v1/txn", json={"success": [{"op": "delete", "key": "k"}]})):
        document = assert_problem(response, 504)
        assert document["indeterminate"] is True


async def test_not_ready_reads_and_readyz_are_503(faulty: FaultyService, faulty_client: httpx.AsyncClient) -> None:
    faulty.faults["wait_readable"] = NotReadyError("below the dirty offset")
    assert_problem(await faulty_client.get("/v1/kv/k"), 503)
    head = await faulty_client.head("/v1/kv/k")
    assert head.status_code == 503 and head.content == b""
    assert_node_headers(head)
    assert_problem(await faulty_client.get("/v1/kv"), 503)
    assert_problem(await faulty_client.get("/v1/watch", params={"timeout_ms": 0}), 503)
    faulty.ready = False
    response = await faulty_client.get("/readyz")
    assert_problem(response, 503)
    faulty.ready = True
    assert (await faulty_client.get("/readyz")).json() == {"ready": True}


async def test_version_wait_timeout_is_504_with_current_version(faulty: FaultyService,
                                                                faulty_client: httpx.AsyncClient) -> None:
    faulty.faults["wait_readable"] = VersionWaitTimeoutError(current_version=41)
    document = assert_problem(await faulty_client.get("/v1/kv/k", params={"min_version": 42}), 504)
    assert document["current_version"] == 41


async def test_unexpected_exception_is_500_problem_without_traceback(faulty: FaultyService,
                                                                     faulty_client: httpx.AsyncClient,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    faulty.faults["propose"] = RuntimeError("secret internal detail")
    with caplog.at_level(logging.ERROR, logger="metakv.http"):
        response = await faulty_client.put("/v1/kv/k", content=b"v")
    document = assert_problem(response, 500)
    assert "secret internal detail" not in response.text and "Traceback" not in response.text
    assert document["type"] == "urn:metakv:problem:internal-error"
    assert "secret internal detail" in caplog.text


async def test_quorum_on_non_leader_is_307(faulty: FaultyService, faulty_client: httpx.AsyncClient) -> None:
    faulty.faults["quorum"] = NotLeaderError("http://127.0.0.1:8003", leader_id=3)
    response = await faulty_client.get("/v1/quorum")
    assert response.status_code == 307
    assert response.headers["location"] == "http://127.0.0.1:8003/v1/quorum"


async def test_admin_routes(faulty: FaultyService, faulty_client: httpx.AsyncClient) -> None:
    assert_problem(await faulty_client.post("/v1/admin/snapshot"), 503)  # nothing applied yet
    await faulty_client.put("/v1/kv/k", content=b"v")
    snapshot = await faulty_client.post("/v1/admin/snapshot")
    assert snapshot.status_code == 200
    assert snapshot.json() == {"snapshot_id": {"end_offset": 1, "epoch": 1}}
    assert (await faulty_client.post("/v1/admin/compact")).json() == {"dirty_offset": 1}
    assert (await faulty_client.post("/v1/admin/resign")).json() == {"resigned": True, "epoch": 1}
    faulty.faults["resign"] = NotLeaderError("http://127.0.0.1:8002", leader_id=2)
    resign = await faulty_client.post("/v1/admin/resign")
    assert resign.status_code == 307 and resign.headers["location"] == "http://127.0.0.1:8002/v1/admin/resign"
    faulty.faults["compact"] = NotLeaderError(None)
    assert_problem(await faulty_client.post("/v1/admin/compact"), 503)


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/status/"), ("GET", "/v1/watch/?prefix=a"),
                                             ("POST", "/v1/txn/"), ("GET", "/healthz/"), ("GET", "/v1/quorum/")])
async def test_trailing_slash_on_a_route_is_404_problem_not_a_redirect(client: httpx.AsyncClient, service: InProcessService,
                                                                       method: str, path: str) -> None:
    response = await client.request(method, path, json={"success": [{"op": "put", "key": "a", "value": "x"}]}
                                    if method == "POST" else None)
    document = assert_problem(response, 404)
    assert document["type"] == "urn:metakv:problem:not-found"
    assert "location" not in response.headers
    assert service.proposals == 0


async def test_list_route_with_trailing_slash_stays_an_invalid_empty_key(client: httpx.AsyncClient) -> None:
    document = assert_problem(await client.get("/v1/kv/?prefix=app"), 400)
    assert document["type"] == "urn:metakv:problem:invalid-key"


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/v1/status", "/v1/quorum", "/v1/kv?prefix=a", "/metrics"])
async def test_head_on_a_get_route_answers_the_get_status_and_headers_without_body(client: httpx.AsyncClient,
                                                                                   path: str) -> None:
    await client.put("/v1/kv/a", content=b"v", headers={"content-type": "text/plain"})
    got = await client.get(path)
    head = await client.head(path)
    assert got.status_code == head.status_code == 200
    assert got.content and head.content == b""
    assert_node_headers(head, version=1)
    assert head.headers["content-type"] == got.headers["content-type"]
    if path == "/metrics":  # the GET itself was counted in between: only the length differs
        assert int(head.headers["content-length"]) > 0
    else:
        assert dict(head.headers) == dict(got.headers)
        assert int(head.headers["content-length"]) == len(got.content)


async def test_head_answers_the_get_problem_status_without_body(faulty: FaultyService,
                                                                faulty_client: httpx.AsyncClient) -> None:
    faulty.ready = False
    not_ready = await faulty_client.head("/readyz")
    assert not_ready.status_code == 503 and not_ready.content == b""
    assert int(not_ready.headers["retry-after"]) >= 1
    assert not_ready.headers["content-type"] == "application/problem+json"
    assert_node_headers(not_ready)
    bad = await faulty_client.head("/v1/kv", params={"limit": 0})
    assert bad.status_code == 400 and bad.content == b""
    faulty.faults["wait_readable"] = NotLeaderError("http://leader:8001", leader_id=3)
    moved = await faulty_client.head("/v1/kv", params={"consistency": "leader"})
    assert moved.status_code == 307 and moved.content == b""
    assert moved.headers["location"] == "http://leader:8001/v1/kv?consistency=leader"
    not_allowed = await faulty_client.head("/v1/txn")
    assert not_allowed.status_code == 405 and not_allowed.content == b""


async def test_compact_route_exists_only_when_the_service_compacts(client: httpx.AsyncClient) -> None:
    assert_problem(await client.post("/v1/admin/compact"), 404)
    paths = (await client.get("/openapi.json")).json()["paths"]
    assert "/v1/admin/compact" not in paths


async def test_status_health_and_quorum(client: httpx.AsyncClient, service: InProcessService) -> None:
    await client.put("/v1/kv/k", content=b"v")
    status = await client.get("/v1/status")
    assert status.status_code == 200
    assert status.json()["applied_version"] == 1 and status.json()["role"] == "leader"
    assert status.json() == service.status()  # passed through: no field invented, none dropped
    assert_node_headers(status, version=1)
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    assert (await client.get("/readyz")).json() == {"ready": True}
    quorum = (await client.get("/v1/quorum")).json()
    assert quorum == service.quorum()
    schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
    assert {"applied_version", "high_watermark", "dirty_offset", "snapshot_id", "ready"} <= set(schemas["StatusResponse"]["properties"])


async def test_metrics_count_requests_by_route_and_status_in_the_service_registry(
        client: httpx.AsyncClient, service: InProcessService) -> None:
    await client.put("/v1/kv/a", content=b"v")
    await client.get("/v1/kv/a")
    await client.get("/v1/kv/missing")
    await client.get("/v1/kv/missing")
    await client.get("/no/such/route")
    text = (await client.get("/metrics")).text
    assert 'metakv_http_requests_total{method="GET",route="unmatched",status="404"} 1.0' in text
    assert 'metakv_http_requests_total{method="GET",route="/v1/kv/{key:path}",status="404"} 2.0' in text
    assert 'metakv_http_requests_total{method="PUT",route="/v1/kv/{key:path}",status="200"} 1.0' in text
    assert 'metakv_http_request_duration_seconds_count{method="GET",route="/v1/kv/{key:path}"} 3.0' in text
    registry_value = service.metrics.get_sample_value(
        "metakv_http_requests_total", {"method": "GET", "route": "/v1/kv/{key:path}", "status": "200"})
    assert registry_value == 1.0


async def test_second_app_on_one_service_shares_its_metrics(service: InProcessService) -> None:
    for _ in range(2):
        transport = httpx.ASGITransport(app=create_app(service, HttpSettings()))
        async with httpx.AsyncClient(transport=transport, base_url="http://node1") as http:
            assert (await http.get("/healthz")).status_code == 200
    value = service.metrics.get_sample_value(
        "metakv_http_requests_total", {"method": "GET", "route": "/healthz", "status": "200"})
    assert value == 2.0


async def test_service_max_value_bytes_is_the_default_limit(tmp_path: Path) -> None:
    node = InProcessService(str(tmp_path / "s.db"), str(tmp_path / "snap"), max_value_bytes=10)
    try:
        transport = httpx.ASGITransport(app=create_app(node))
        async with httpx.AsyncClient(transport=transport, base_url="http://node1") as http:
            assert (await http.put("/v1/kv/k", content=b"x" * 10)).status_code == 200
            assert_problem(await http.put("/v1/kv/k", content=b"x" * 11), 413)
    finally:
        node.close()


EXPECTED_STATUSES = {
    ("/v1/kv/{key}", "get"): {"200", "307", "400", "404", "410", "413", "503", "504"},
    ("/v1/kv/{key}", "head"): {"200", "307", "400", "404", "410", "413", "503", "504"},
    ("/v1/kv/{key}", "put"): {"200", "307", "400", "404", "412", "413", "503", "504", "507"},
    ("/v1/kv/{key}", "delete"): {"200", "307", "400", "412", "413", "503", "504"},
    ("/v1/kv", "get"): {"200", "307", "400", "410", "503", "504"},
    ("/v1/kv", "head"): {"200", "307", "400", "410", "503", "504"},
    ("/v1/txn", "post"): {"200", "307", "400", "404", "413", "422", "503", "504", "507"},
    ("/v1/watch", "get"): {"200", "400", "410", "429", "503"},
    ("/v1/status", "get"): {"200"},
    ("/v1/status", "head"): {"200"},
    ("/v1/quorum", "get"): {"200", "307", "503"},
    ("/v1/quorum", "head"): {"200", "307", "503"},
    ("/healthz", "get"): {"200"},
    ("/healthz", "head"): {"200"},
    ("/readyz", "get"): {"200", "503"},
    ("/readyz", "head"): {"200", "503"},
    ("/metrics", "get"): {"200"},
    ("/metrics", "head"): {"200"},
    ("/v1/admin/snapshot", "post"): {"200", "503", "507"},
    ("/v1/admin/snapshot/download", "post"): {"200", "503", "507"},
    ("/v1/admin/resign", "post"): {"200", "307", "503"},
    ("/v1/admin/compact", "post"): {"200", "307", "503"},
    ("/v1/leases", "get"): {"200", "503"},
    ("/v1/leases", "post"): {"201", "307", "400", "409", "413", "422", "503", "504", "507"},
    ("/v1/leases/keepalive", "post"): {"200", "307", "400", "413", "422", "503", "504"},
    ("/v1/leases/{lease_id}/keepalive", "post"): {"200", "307", "400", "404", "503", "504"},
    ("/v1/leases/{lease_id}", "delete"): {"200", "307", "400", "404", "503", "504"},
    ("/v1/leases/{lease_id}", "get"): {"200", "307", "400", "404", "503", "504"},
    ("/v1/admin/voters", "post"): {"200", "307", "400", "409", "413", "422", "503", "504"},
    ("/v1/admin/voters/{node_id}", "delete"): {"200", "307", "400", "404", "409", "503", "504"},
}


async def test_openapi_documents_every_route_status_and_problem_schema(faulty_client: httpx.AsyncClient) -> None:
    document = (await faulty_client.get("/openapi.json")).json()
    documented = {(path, method): set(operation["responses"])
                  for path, item in document["paths"].items() for method, operation in item.items()}
    assert documented == EXPECTED_STATUSES
    schemas = document["components"]["schemas"]
    assert {"Problem", "TxnRequest", "WriteResult", "DeleteResult", "ListResponse", "TxnResponse",
            "WatchResponse"} <= set(schemas)
    assert "HTTPValidationError" not in schemas
    for (path, method), statuses in EXPECTED_STATUSES.items():
        responses = document["paths"][path][method]["responses"]
        success = "201" if "201" in statuses else "200"
        for status in statuses - {success}:
            assert responses[status]["content"]["application/problem+json"]["schema"] == {"$ref": "#/components/schemas/Problem"}
        assert "X-Metadata-Version" in responses[success]["headers"]
    for path, item in document["paths"].items():
        if "head" in item:  # the headers of GET, never a body
            assert "content" not in item["head"]["responses"]["200"], path
    get_params = {p["name"] for p in document["paths"]["/v1/kv/{key}"]["get"]["parameters"]}
    assert get_params == {"key", "consistency", "min_version", "wait_ms", "at_version"}
    list_params = {p["name"] for p in document["paths"]["/v1/kv"]["get"]["parameters"]}
    assert {"prefix", "limit", "after", "keys_only"} <= list_params
    watch_params = {p["name"] for p in document["paths"]["/v1/watch"]["get"]["parameters"]}
    assert {"prefix", "since", "timeout_ms"} <= watch_params
    put_headers = {p["name"] for p in document["paths"]["/v1/kv/{key}"]["put"]["parameters"] if p["in"] == "header"}
    assert put_headers == {"If-Match", "If-None-Match"}
    assert document["paths"]["/v1/txn"]["post"]["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/TxnRequest"}


class ClosingService(InProcessService):
    """A node shutting down: its watches no longer wait."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.watch_hub.close()


async def test_watch_answers_at_once_when_the_node_stops_waiting(tmp_path: Path) -> None:
    node = ClosingService(str(tmp_path / "s.db"), str(tmp_path / "snap"))
    try:
        transport = httpx.ASGITransport(app=create_app(node, TEST_SETTINGS))
        async with httpx.AsyncClient(transport=transport, base_url="http://node1") as http:
            response = await http.get("/v1/watch", params={"since": 0, "timeout_ms": 2000})
        assert response.json() == {"version": 0, "events": []}
        assert node.waits_started == 0
    finally:
        node.close()


async def test_sse_stream_ends_when_the_node_stops_waiting(tmp_path: Path) -> None:
    node = ClosingService(str(tmp_path / "s.db"), str(tmp_path / "snap"))
    try:
        # Long waits, so only a node that stopped waiting (not a slow machine) ends it early.
        settings = HttpSettings(sse_keepalive_ms=60_000, max_watch_timeout_ms=120_000)
        transport = httpx.ASGITransport(app=create_app(node, settings))
        async with httpx.AsyncClient(transport=transport, base_url="http://node1") as http:
            response = await http.get("/v1/watch", params={"since": 0, "timeout_ms": 120_000},
                                      headers={"accept": "text/event-stream"})
        assert response.status_code == 200
        assert "keepalive" not in response.text
        assert node.waits_started == 0
    finally:
        node.close()


async def test_middleware_wraps_the_app_and_sees_key_routes(service: InProcessService) -> None:
    """The key routes bypass FastAPI's middleware stack, so FastAPI middleware is refused
    (it would silently miss /v1/kv/) and a wrapping ASGI middleware sees every route."""
    app = create_app(service, TEST_SETTINGS)
    with pytest.raises(RuntimeError, match="wrap the ASGI app"):
        app.add_middleware(GZipMiddleware)
    seen: list[str] = []

    async def wrapper(scope: Any, receive: Any, send: Any) -> None:
        seen.append(f"{scope.get('method')} {scope.get('path')}")
        await app(scope, receive, send)

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=wrapper), base_url="http://node1") as http:
        assert (await http.put("/v1/kv/a", content=b"v")).status_code == 200
        assert (await http.get("/v1/kv/a")).content == b"v"
        assert (await http.get("/healthz")).status_code == 200
    assert seen == ["PUT /v1/kv/a", "GET /v1/kv/a", "GET /healthz"]
