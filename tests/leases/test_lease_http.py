"""The lease routes over HTTP against one in-process leader (tests/http/service_double.py):
what a client sees for good and bad input, per docs/http.md "Leases"."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.anyio


async def grant(client: httpx.AsyncClient, ttl_s: int = 60, **extra: int) -> dict:
    response = await client.post("/v1/leases", json={"ttl_s": ttl_s, **extra})
    assert response.status_code == 201, response.text
    return response.json()


def problem(response: httpx.Response, status: int, slug: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    document = response.json()
    assert document["type"] == f"urn:metakv:problem:{slug}"
    return document


async def test_grant_attach_read_and_revoke_in_one_version(client):
    lease = await grant(client, 60, id=7)
    assert lease["id"] == 7 and lease["ttl_s"] == 60
    for key in ("svc/a", "svc/b"):
        assert (await client.put(f"/v1/kv/{key}?lease=7", content=b"up")).status_code == 200
    await client.put("/v1/kv/svc/c", content=b"plain")
    got = await client.get("/v1/kv/svc/a")
    assert got.headers["x-lease"] == "7"
    assert "x-lease" not in (await client.get("/v1/kv/svc/c")).headers
    items = {item["key"]: item for item in (await client.get("/v1/kv", params={"prefix": "svc/"})).json()["items"]}
    assert items["svc/a"]["lease"] == 7 and "lease" not in items["svc/c"]
    info = (await client.get("/v1/leases/7", params={"keys": "true"})).json()
    assert info["keys"] == ["svc/a", "svc/b"] and info["granted_version"] == lease["version"]
    assert 0 < info["remaining_s"] <= 60
    since = (await client.get("/v1/kv", params={"prefix": "svc/"})).json()["version"]

    revoked = (await client.delete("/v1/leases/7")).json()
    assert revoked["deleted_keys"] == 2
    events = (await client.get("/v1/watch", params={"prefix": "svc/", "since": since, "wait_ms": 0})).json()["events"]
    assert [(event["key"], event["type"], event["mod_version"], event.get("reason")) for event in events] == [
        ("svc/a", "delete", revoked["version"], "lease-revoked"),
        ("svc/b", "delete", revoked["version"], "lease-revoked")]
    assert (await client.get("/v1/kv/svc/c")).status_code == 200
    problem(await client.get("/v1/kv/svc/a"), 404, "key-not-found")


async def test_a_put_without_the_lease_detaches_the_key(client):
    await grant(client, 60, id=3)
    await client.put("/v1/kv/k?lease=3", content=b"1")
    await client.put("/v1/kv/k", content=b"2")
    assert (await client.get("/v1/leases/3", params={"keys": "true"})).json()["keys"] == []
    assert (await client.delete("/v1/leases/3")).json()["deleted_keys"] == 0
    assert (await client.get("/v1/kv/k")).content == b"2"


async def test_leases_are_hidden_from_list_and_watch(client):
    await grant(client, 60, id=5)
    await client.put("/v1/kv/x?lease=5", content=b"v")
    listed = (await client.get("/v1/kv")).json()["items"]
    assert [item["key"] for item in listed] == ["x"]
    events = (await client.get("/v1/watch", params={"since": 0, "wait_ms": 0})).json()["events"]
    assert [event["key"] for event in events] == ["x"]
    assert (await client.get("/v1/kv", params={"prefix": "\x00"})).json()["items"] == []
    assert (await client.get("/v1/leases")).json()["leases"] == [{"id": 5, "ttl_s": 60}]


async def test_txn_puts_take_a_lease(client):
    await grant(client, 60, id=9)
    body = {"compare": [{"key": "lock", "exists": False}],
            "success": [{"op": "put", "key": "lock", "value": "me", "lease": 9}],
            "failure": [{"op": "get", "key": "lock"}]}
    answer = (await client.post("/v1/txn", json=body)).json()
    assert answer["succeeded"] and answer["results"] == [{"op": "put", "key": "lock", "created": True}]
    assert (await client.get("/v1/kv/lock")).headers["x-lease"] == "9"
    body["success"][0]["lease"] = 10
    body["compare"] = []
    problem(await client.post("/v1/txn", json=body), 404, "lease-not-found")


async def test_batch_keepalive(client):
    ids = [(await grant(client, 30 + index))["id"] for index in range(3)]
    answer = (await client.post("/v1/leases/keepalive", json={"ids": [*ids, 424242]})).json()
    assert answer == {"leases": [{"id": lease_id, "ttl_s": 30 + index} for index, lease_id in enumerate(ids)],
                      "not_found": [424242]}
    one = (await client.post(f"/v1/leases/{ids[0]}/keepalive")).json()
    assert one == {"id": ids[0], "ttl_s": 30}
    metrics = (await client.get("/metrics")).text
    assert "metakv_leases 3.0" in metrics and "metakv_lease_keepalives_total 4.0" in metrics


@pytest.mark.parametrize("ttl_s", [0, -5, 86_401])
async def test_a_ttl_out_of_bounds_is_400(client, ttl_s):
    problem(await client.post("/v1/leases", json={"ttl_s": ttl_s}), 400, "invalid-ttl")


async def test_unknown_leases_are_404(client):
    problem(await client.post("/v1/leases/99/keepalive"), 404, "lease-not-found")
    problem(await client.delete("/v1/leases/99"), 404, "lease-not-found")
    problem(await client.get("/v1/leases/99"), 404, "lease-not-found")
    document = problem(await client.put("/v1/kv/k?lease=99", content=b"v"), 404, "lease-not-found")
    assert document["lease"] == 99
    problem(await client.get("/v1/kv/k"), 404, "key-not-found")  # the write did not happen


async def test_a_taken_id_is_409(client):
    await grant(client, 60, id=11)
    problem(await client.post("/v1/leases", json={"ttl_s": 60, "id": 11}), 409, "lease-exists")


@pytest.mark.parametrize("body", [b"", b"not json", b"[]", b'{"ttl_s": 10, "id": 0}',
                                  b'{"ttl_s": 10, "id": -1}', b'{"ttl_s": 10, "extra": 1}', b'{"ttl_s": 1.5}',
                                  b'{"ttl_s": 10, "id": 99999999999999999999}'])
async def test_malformed_grant_bodies_are_422(client, body):
    problem(await client.post("/v1/leases", content=body), 422, "invalid-body")


@pytest.mark.parametrize("body", [b"{}", b'{"ids": "1"}', b'{"ids": [0]}', b'{"ids": [true]}',
                                  b'{"ids": [' + b",".join([b"1"] * 10_001) + b"]}"])
async def test_malformed_keepalive_bodies_are_422(client, body):
    problem(await client.post("/v1/leases/keepalive", content=body), 422, "invalid-body")


@pytest.mark.parametrize("path", ["/v1/leases/0", "/v1/leases/99999999999999999999"])
async def test_out_of_range_lease_ids_in_paths_are_400(client, path):
    problem(await client.get(path), 400, "invalid-parameter")


@pytest.mark.parametrize("path", ["/v1/leases/abc", "/v1/leases/-3"])
async def test_lease_paths_that_are_not_numbers_are_404(client, path):
    problem(await client.get(path), 404, "not-found")


async def test_the_batch_route_allows_post_only(client):
    answer = problem(await client.get("/v1/leases/keepalive"), 405, "method-not-allowed")
    assert answer and (await client.get("/v1/leases/keepalive")).headers["allow"] == "POST"


@pytest.mark.parametrize("query", ["lease=abc", "lease=-1", "lease=99999999999999999999"])
async def test_bad_lease_on_put_is_400(client, query):
    problem(await client.put(f"/v1/kv/k?{query}", content=b"v"), 400, "invalid-parameter")


async def test_a_page_of_internal_changes_only_is_read_past(service):
    for lease_id in (1, 2, 3):
        await service.grant_lease(60, lease_id)
    await service.put("k", b"v")
    page = service.changes("", 0, 1)  # three grants, then the put: one change a page
    assert [(event.key, event.mod_version) for event in page.events] == [("k", 4)] and page.version == 4
