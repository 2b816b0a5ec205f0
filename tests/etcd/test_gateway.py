"""etcd's v3 JSON gateway against an in-process node: the same calls as gRPC as JSON POSTs,
base64 keys and values, grpc-gateway's error bodies, and watches as JSON lines."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from app.etcd.gateway import EtcdGateway
from app.etcd.mapping import EtcdMapping, prefix_end
from tests.http.service_double import InProcessService

pytestmark = pytest.mark.anyio
WAIT_S = 10


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


@pytest.fixture
async def gateway(service: InProcessService) -> AsyncIterator[httpx.AsyncClient]:
    mapping = EtcdMapping(service, "test-cluster", {1: []})
    server = EtcdGateway(mapping, "127.0.0.1", 0)
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as client:
            yield client
    finally:
        await server.stop()
        await mapping.close()


async def test_kv_calls_as_json(gateway: httpx.AsyncClient) -> None:
    put = (await gateway.post("/v3/kv/put", json={"key": b64(b"app/a"), "value": b64(b"1")})).json()
    revision = int(put["header"]["revision"])  # int64s are strings, as in etcd's gateway
    await gateway.post("/v3/kv/put", json={"key": b64(b"app/b"), "value": b64(b"2")})
    got = (await gateway.post("/v3/kv/range", json={"key": b64(b"app/"), "range_end": b64(prefix_end(b"app/")),
                                                     "sort_order": "DESCEND"})).json()
    assert [(base64.b64decode(kv["key"]), base64.b64decode(kv["value"])) for kv in got["kvs"]] == [
        (b"app/b", b"2"), (b"app/a", b"1")]
    assert got["count"] == "2" and got["kvs"][1]["create_revision"] == str(revision)
    txn = (await gateway.post("/v3/kv/txn", json={
        "compare": [{"key": b64(b"app/a"), "target": "VALUE", "result": "EQUAL", "value": b64(b"1")}],
        "success": [{"request_delete_range": {"key": b64(b"app/a"), "prev_kv": True}}]})).json()
    assert txn["succeeded"] is True
    assert txn["responses"][0]["response_delete_range"]["deleted"] == "1"
    status = (await gateway.post("/v3/maintenance/status", json={})).json()
    assert status["leader"] == "1" and status["header"]["member_id"] == "1"


async def test_errors_are_grpc_gateway_bodies(gateway: httpx.AsyncClient) -> None:
    future = await gateway.post("/v3/kv/range", json={"key": b64(b"k"), "revision": 1000})
    assert future.status_code == 400
    assert future.json() == {"error": "etcdserver: mvcc: required revision is a future revision", "code": 11,
                             "message": "etcdserver: mvcc: required revision is a future revision"}
    empty = await gateway.post("/v3/kv/put", json={"value": b64(b"v")})
    assert empty.status_code == 400 and empty.json()["message"] == "etcdserver: key is not provided"
    assert (await gateway.post("/v3/kv/put", content=b"{not json")).status_code == 400
    assert (await gateway.post("/v3/auth/status", json={})).status_code == 501


async def test_lease_calls_as_json(gateway: httpx.AsyncClient) -> None:
    granted = (await gateway.post("/v3/lease/grant", json={"TTL": 30})).json()
    lease = granted["ID"]
    assert granted["TTL"] == "30"
    await gateway.post("/v3/kv/put", json={"key": b64(b"l/a"), "value": b64(b"1"), "lease": lease})
    got = (await gateway.post("/v3/kv/range", json={"key": b64(b"l/a")})).json()
    assert got["kvs"][0]["lease"] == lease
    kept = (await gateway.post("/v3/lease/keepalive", json={"ID": lease})).json()
    assert kept["result"]["ID"] == lease and kept["result"]["TTL"] == "30"
    ttl = (await gateway.post("/v3/kv/lease/timetolive", json={"ID": lease, "keys": True})).json()
    assert ttl["grantedTTL"] == "30" and ttl["keys"] == [b64(b"l/a")]
    assert (await gateway.post("/v3/lease/leases", json={})).json()["leases"] == [{"ID": lease}]
    assert (await gateway.post("/v3/kv/lease/revoke", json={"ID": lease})).status_code == 200
    assert "kvs" not in (await gateway.post("/v3/kv/range", json={"key": b64(b"l/a")})).json()
    gone = await gateway.post("/v3/lease/revoke", json={"ID": lease})
    assert gone.status_code == 404 and gone.json()["message"] == "etcdserver: requested lease not found"
    assert (await gateway.post("/v3/lease/keepalive", json={"ID": lease})).json()["result"].get("TTL") is None


async def test_watch_streams_json_lines(gateway: httpx.AsyncClient) -> None:
    first = (await gateway.post("/v3/kv/put", json={"key": b64(b"w/1"), "value": b64(b"a")})).json()
    await gateway.post("/v3/kv/put", json={"key": b64(b"w/2"), "value": b64(b"b")})
    request = {"create_request": {"key": b64(b"w/"), "range_end": b64(prefix_end(b"w/")),
                                  "start_revision": first["header"]["revision"]}}
    async with gateway.stream("POST", "/v3/watch", json=request) as stream:
        lines = stream.aiter_lines()
        created = json.loads(await anext(lines))["result"]
        assert created["created"] is True
        events = json.loads(await anext(lines))["result"]["events"]
        assert [base64.b64decode(event["kv"]["value"]) for event in events] == [b"a", b"b"]


async def test_a_value_that_is_not_base64_is_refused_not_stored_mangled(gateway: httpx.AsyncClient) -> None:
    """protobuf's JSON parser drops the characters that are not base64: "hello world!" was
    stored as the bytes of "helloworlQ==" and answered 200. etcd's gateway refuses it."""
    bodies = [("/v3/kv/put", {"key": b64(b"k"), "value": "hello world!"}, 5),
              ("/v3/kv/range", {"key": "!!!"}, 0),
              ("/v3/kv/txn", {"success": [{"request_put": {"key": b64(b"k"), "value": "abcde"}}]}, 4),
              # as etcd's: the standard alphabet, padded
              ("/v3/kv/put", {"key": "a-_", "value": b64(b"v")}, 1), ("/v3/kv/put", {"key": "YQ"}, 0)]
    for path, body, byte in bodies:
        refused = await gateway.post(path, json=body)
        message = f"illegal base64 data at input byte {byte}"
        assert (refused.status_code, refused.json()) == (400, {"error": message, "code": 3, "message": message})
    assert not (await gateway.post("/v3/kv/range", json={"key": b64(b"k")})).json().get("kvs")
