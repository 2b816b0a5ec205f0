"""Keys: PUT / GET / HEAD / DELETE, conditions, versions, and bad input, as a client sees them."""

from __future__ import annotations

import asyncio
import re
from urllib.parse import quote

import httpx
import pytest

from app.http import create_app
from tests.http.conftest import TEST_SETTINGS
from tests.http.service_double import InProcessService

pytestmark = pytest.mark.anyio

NODE_HEADERS = ("x-metadata-version", "x-node-id", "x-raft-leader", "x-raft-epoch", "x-last-contact-ms")


def assert_node_headers(response: httpx.Response, version: int | None = None) -> None:
    for name in NODE_HEADERS:
        assert name in response.headers, f"{name} missing on {response.status_code}"
    assert response.headers["x-node-id"] == "1"
    assert response.headers["x-raft-leader"] == "1"
    if version is not None:
        assert response.headers["x-metadata-version"] == str(version)


def assert_problem(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    document = response.json()
    assert document["status"] == status
    assert document["type"].startswith("urn:metakv:problem:")
    assert document["title"] and document["detail"]
    assert_node_headers(response)
    return document


async def test_put_then_get_returns_bytes_with_stored_content_type(client: httpx.AsyncClient) -> None:
    put = await client.put("/v1/kv/config/db", content=b"\x00\x01binary", headers={"content-type": "application/x-thing"})
    assert put.status_code == 200
    assert put.json() == {"key": "config/db", "version": 1, "created": True}
    assert_node_headers(put, version=1)

    got = await client.get("/v1/kv/config/db")
    assert got.status_code == 200
    assert got.content == b"\x00\x01binary"
    assert got.headers["content-type"] == "application/x-thing"
    assert got.headers["etag"] == '"1"'
    assert got.headers["x-create-version"] == "1"
    assert got.headers["x-key-version"] == "1"
    assert_node_headers(got, version=1)
    await client.put("/v1/kv/config/db", content=b"again")
    assert (await client.get("/v1/kv/config/db")).headers["x-key-version"] == "2"


async def test_text_content_type_is_stored_verbatim(client: httpx.AsyncClient) -> None:
    await client.put("/v1/kv/t", content="héllo".encode("latin-1"), headers={"content-type": "text/plain; charset=latin-1"})
    got = await client.get("/v1/kv/t")
    assert got.headers["content-type"] == "text/plain; charset=latin-1"
    assert got.content == "héllo".encode("latin-1")


async def test_put_without_content_type_stores_octet_stream(client: httpx.AsyncClient) -> None:
    await client.put("/v1/kv/raw", content=b"x", headers={"content-type": ""})
    got = await client.get("/v1/kv/raw")
    assert got.headers["content-type"] == "application/octet-stream"


async def test_overwrite_keeps_create_version_and_moves_mod_version(client: httpx.AsyncClient) -> None:
    await client.put("/v1/kv/k", content=b"1")
    await client.put("/v1/kv/other", content=b"x")
    second = await client.put("/v1/kv/k", content=b"2")
    assert second.json() == {"key": "k", "version": 3, "created": False}
    got = await client.get("/v1/kv/k")
    assert got.content == b"2"
    assert got.headers["etag"] == '"3"'
    assert got.headers["x-create-version"] == "1"


async def test_head_has_get_headers_and_no_body(client: httpx.AsyncClient) -> None:
    await client.put("/v1/kv/h", content=b"12345", headers={"content-type": "text/csv"})
    head = await client.head("/v1/kv/h")
    assert head.status_code == 200
    assert head.content == b""
    assert head.headers["content-length"] == "5"
    assert head.headers["content-type"] == "text/csv"
    assert head.headers["etag"] == '"1"'
    assert_node_headers(head, version=1)
    missing = await client.head("/v1/kv/nothing")
    assert missing.status_code == 404
    assert missing.content == b""
    assert_node_headers(missing)


async def test_get_missing_key_is_404_problem_with_version_headers(client: httpx.AsyncClient) -> None:
    await client.put("/v1/kv/present", content=b"x")
    document = assert_problem(await client.get("/v1/kv/absent"), 404)
    assert "absent" in document["detail"]


async def test_delete_answers_deleted_and_missing_delete_is_200_false(client: httpx.AsyncClient) -> None:
    await client.put("/v1/kv/d", content=b"x")
    first = await client.delete("/v1/kv/d")
    assert first.status_code == 200
    assert first.json() == {"key": "d", "version": 2, "deleted": True}
    assert (await client.get("/v1/kv/d")).status_code == 404
    again = await client.delete("/v1/kv/d")
    assert again.status_code == 200
    assert again.json() == {"key": "d", "version": 3, "deleted": False}


async def test_if_match_is_compare_and_set(client: httpx.AsyncClient) -> None:
    await client.put("/v1/kv/cas", content=b"a")
    ok = await client.put("/v1/kv/cas", content=b"b", headers={"if-match": '"1"'})
    assert ok.status_code == 200 and ok.json()["version"] == 2
    stale = await client.put("/v1/kv/cas", content=b"c", headers={"if-match": '"1"'})
    document = assert_problem(stale, 412)
    assert document["current_version"] == 2
    assert (await client.get("/v1/kv/cas")).content == b"b"


async def test_if_none_match_star_is_create_only(client: httpx.AsyncClient) -> None:
    created = await client.put("/v1/kv/once", content=b"a", headers={"if-none-match": "*"})
    assert created.status_code == 200 and created.json()["created"] is True
    document = assert_problem(await client.put("/v1/kv/once", content=b"b", headers={"if-none-match": "*"}), 412)
    assert document["current_version"] == 1
    assert (await client.get("/v1/kv/once")).content == b"a"


async def test_if_match_and_if_none_match_must_both_hold(client: httpx.AsyncClient) -> None:
    await client.put("/v1/kv/both", content=b"a")
    document = assert_problem(await client.put("/v1/kv/both", content=b"b",
                                               headers={"if-match": "*", "if-none-match": "*"}), 412)
    assert document["current_version"] == 1
    created = await client.put("/v1/kv/fresh", content=b"b", headers={"if-match": "0", "if-none-match": "*"})
    assert created.status_code == 200 and created.json()["created"] is True


async def test_if_match_on_delete(client: httpx.AsyncClient) -> None:
    await client.put("/v1/kv/dm", content=b"a")
    assert_problem(await client.delete("/v1/kv/dm", headers={"if-match": '"7"'}), 412)
    ok = await client.delete("/v1/kv/dm", headers={"if-match": '"1"'})
    assert ok.json()["deleted"] is True


async def test_weak_if_match_never_matches_and_is_412(client: httpx.AsyncClient, service: InProcessService) -> None:
    # RFC 9110 §13.1.1: If-Match compares strongly, so W/"1" fails even when the key is at 1.
    await client.put("/v1/kv/weak", content=b"a")
    for weak in ('W/"1"', 'W/"1", W/"7"'):
        document = assert_problem(await client.put("/v1/kv/weak", content=b"b", headers={"if-match": weak}), 412)
        assert document["type"] == "urn:metakv:problem:precondition-failed"
        assert document["current_version"] == 1
        assert_problem(await client.delete("/v1/kv/weak", headers={"if-match": weak}), 412)
    got = await client.get("/v1/kv/weak")
    assert got.content == b"a" and got.headers["etag"] == '"1"'
    assert_problem(await client.put("/v1/kv/never", content=b"b", headers={"if-match": 'W/"0"'}), 412)
    assert (await client.get("/v1/kv/never")).status_code == 404


async def test_if_match_list_matches_its_one_strong_tag_and_ignores_weak_ones(client: httpx.AsyncClient) -> None:
    await client.put("/v1/kv/l", content=b"a")
    ok = await client.put("/v1/kv/l", content=b"b", headers={"if-match": 'W/"1", "1"'})
    assert ok.status_code == 200 and ok.json()["version"] == 2
    document = assert_problem(await client.put("/v1/kv/l", content=b"c", headers={"if-match": '"1" , W/"2"'}), 412)
    assert document["current_version"] == 2
    assert (await client.get("/v1/kv/l")).content == b"b"


@pytest.mark.parametrize("value", ['"1", "2"', '"2", "2"', 'W/"9", "1", 2'])
async def test_if_match_list_of_several_strong_tags_is_400_not_supported(client: httpx.AsyncClient,
                                                                         value: str) -> None:
    await client.put("/v1/kv/many", content=b"a")
    await client.put("/v1/kv/many", content=b"b")
    document = assert_problem(await client.put("/v1/kv/many", content=b"c", headers={"if-match": value}), 400)
    assert document["type"] == "urn:metakv:problem:invalid-precondition"
    assert "lists of several entity tags are not supported" in document["detail"]
    assert (await client.get("/v1/kv/many")).content == b"b"


async def test_if_match_star_with_entity_tags_is_400(client: httpx.AsyncClient) -> None:
    await client.put("/v1/kv/star", content=b"a")
    document = assert_problem(await client.put("/v1/kv/star", content=b"b", headers={"if-match": '*, "1"'}), 400)
    assert "cannot be combined" in document["detail"]
    assert (await client.get("/v1/kv/star")).content == b"a"


IF_MATCH_VALUES = ['*', '"5"', '5', 'W/"5"', 'W/"1", "2"', '"1",W/"2"', 'W/"1" , W/"2"', '"1", "2"', '*, "1"',
                   'abc', '"1', '1"', 'W/5', '"1",', '"99999999999999999999"', '"1"2', 'W/"1"W/"2"', '","']


async def test_if_match_is_refused_exactly_when_the_documented_pattern_does_not_match(client: httpx.AsyncClient) -> None:
    """The fuzzer trusts /openapi.json: a value matching its If-Match pattern must be
    accepted (200 or 412), any other must be 400."""
    operation = (await client.get("/openapi.json")).json()["paths"]["/v1/kv/{key}"]["put"]
    [parameter] = [p for p in operation["parameters"] if p["name"] == "If-Match"]
    pattern = re.compile(parameter["schema"]["pattern"])
    await client.put("/v1/kv/pattern", content=b"a")
    for value in IF_MATCH_VALUES:
        status = (await client.put("/v1/kv/pattern", content=b"b", headers={"if-match": value})).status_code
        assert (status != 400) == bool(pattern.fullmatch(value)), (value, status)


@pytest.mark.parametrize("header", [{"if-match": "abc"}, {"if-match": '"1", "2"'}, {"if-none-match": '"3"'},
                                    {"if-none-match": ""}, {"if-match": '"99999999999999999999"'}])
async def test_malformed_preconditions_are_400(client: httpx.AsyncClient, header: dict[str, str]) -> None:
    assert_problem(await client.put("/v1/kv/p", content=b"x", headers=header), 400)
    assert (await client.get("/v1/kv/p")).status_code == 404


async def test_keys_with_slashes_and_unicode_round_trip(client: httpx.AsyncClient) -> None:
    key = "services/ünïcode/a b?c#d%e"
    put = await client.put("/v1/kv/" + quote(key, safe="/"), content=b"v")
    assert put.json()["key"] == key
    got = await client.get("/v1/kv/" + quote(key, safe="/"))
    assert got.status_code == 200 and got.content == b"v"
    listed = await client.get("/v1/kv", params={"prefix": "services/"})
    assert [item["key"] for item in listed.json()["items"]] == [key]


async def test_keys_with_newlines_round_trip(client: httpx.AsyncClient) -> None:
    # Only NUL is forbidden in a key; a newline (and CR) must reach the key routes, not 404.
    key = "lines/a\nb\r\nc\n"
    put = await client.put("/v1/kv/" + quote(key, safe="/"), content=b"v")
    assert put.status_code == 200 and put.json()["key"] == key
    got = await client.get("/v1/kv/" + quote(key, safe="/"))
    assert got.status_code == 200 and got.content == b"v"
    assert (await client.delete("/v1/kv/" + quote(key, safe="/"))).json()["deleted"] is True


@pytest.mark.parametrize("raw_key", ["", "a%00b", "%FF%FE", "%ED%A0%80"])
async def test_invalid_keys_are_400(client: httpx.AsyncClient, raw_key: str) -> None:
    assert_problem(await client.put("/v1/kv/" + raw_key, content=b"x"), 400)
    assert_problem(await client.get("/v1/kv/" + raw_key), 400)
    assert (await client.get("/v1/kv")).json()["items"] == []


async def test_key_size_limit(client: httpx.AsyncClient) -> None:
    largest = "é" * 512  # 1024 bytes of UTF-8
    assert (await client.put("/v1/kv/" + quote(largest), content=b"x")).status_code == 200
    too_large = largest + "a"
    assert_problem(await client.put("/v1/kv/" + quote(too_large), content=b"x"), 413)
    assert_problem(await client.get("/v1/kv/" + quote(too_large)), 413)


async def test_value_size_limit_from_content_length(client: httpx.AsyncClient, service: InProcessService) -> None:
    limit = TEST_SETTINGS.max_value_bytes
    assert (await client.put("/v1/kv/v", content=b"a" * limit)).status_code == 200
    document = assert_problem(await client.put("/v1/kv/v", content=b"b" * (limit + 1)), 413)
    assert str(limit) in document["detail"]
    got = await client.get("/v1/kv/v")
    assert got.content == b"a" * limit
    assert service.state.applied_version == 1


async def test_value_size_limit_enforced_while_reading_a_chunked_body(client: httpx.AsyncClient,
                                                                      service: InProcessService) -> None:
    async def chunks():
        for _ in range(10):
            yield b"z" * 1000

    response = await client.put("/v1/kv/chunked", content=chunks())
    assert_problem(response, 413)
    assert (await client.get("/v1/kv/chunked")).status_code == 404
    assert service.proposals == 0


async def test_unknown_consistency_is_400(client: httpx.AsyncClient) -> None:
    document = assert_problem(await client.get("/v1/kv/k", params={"consistency": "eventual"}), 400)
    assert "consistency" in document["detail"]
    assert_problem(await client.get("/v1/kv", params={"consistency": "eventual"}), 400)


@pytest.mark.parametrize("consistency", ["local", "leader", "linearizable"])
async def test_every_consistency_level_reads_the_value(client: httpx.AsyncClient, consistency: str) -> None:
    await client.put("/v1/kv/c", content=b"v")
    got = await client.get("/v1/kv/c", params={"consistency": consistency})
    assert got.status_code == 200 and got.content == b"v"


async def test_at_version_reads_history_and_410_below_the_horizon(client: httpx.AsyncClient,
                                                                  service: InProcessService) -> None:
    await client.put("/v1/kv/h", content=b"one")
    await client.put("/v1/kv/h", content=b"two")
    await client.delete("/v1/kv/h")
    assert (await client.get("/v1/kv/h", params={"at_version": 1})).content == b"one"
    assert (await client.get("/v1/kv/h", params={"at_version": 2})).content == b"two"
    assert (await client.get("/v1/kv/h", params={"at_version": 3})).status_code == 404
    service.state.prune_history(2)
    document = assert_problem(await client.get("/v1/kv/h", params={"at_version": 1}), 410)
    assert document["oldest_version"] == 2
    assert (await client.get("/v1/kv/h", params={"at_version": 2})).content == b"two"


async def test_min_version_not_reached_is_504_with_current_version(client: httpx.AsyncClient) -> None:
    await client.put("/v1/kv/m", content=b"x")
    document = assert_problem(await client.get("/v1/kv/m", params={"min_version": 5, "wait_ms": 10}), 504)
    assert document["current_version"] == 1
    future = await client.get("/v1/kv/m", params={"at_version": 9, "wait_ms": 0})
    assert_problem(future, 504)


async def test_min_version_waits_for_a_later_write(client: httpx.AsyncClient, service: InProcessService) -> None:
    reader = asyncio.create_task(client.get("/v1/kv/later", params={"min_version": 1, "wait_ms": 2000}))
    await service.until_waiting()
    await client.put("/v1/kv/later", content=b"arrived")
    got = await asyncio.wait_for(reader, 10)
    assert got.status_code == 200 and got.content == b"arrived"
    assert int(got.headers["x-metadata-version"]) >= 1


async def test_negative_or_non_integer_version_parameters_are_400(client: httpx.AsyncClient) -> None:
    assert_problem(await client.get("/v1/kv/k", params={"min_version": -1}), 400)
    assert_problem(await client.get("/v1/kv/k", params={"at_version": "x"}), 400)
    assert_problem(await client.get("/v1/kv/k", params={"wait_ms": "soon"}), 400)


async def test_unknown_route_and_method_are_problem_documents(client: httpx.AsyncClient) -> None:
    assert_problem(await client.get("/v2/nothing"), 404)
    not_allowed = await client.patch("/v1/kv/k", content=b"x")
    assert_problem(not_allowed, 405)
    assert not_allowed.headers["allow"] == "DELETE, GET, HEAD, PUT"


@pytest.mark.parametrize("content_type", ["text/plain; x=\xe9".encode("latin-1"), b"`", b"text", b"text/plain; charset"])
async def test_content_type_must_be_a_media_type(client: httpx.AsyncClient, content_type: bytes) -> None:
    response = await client.put("/v1/kv/ct", content=b"x", headers={"content-type": content_type})
    assert_problem(response, 400)
    assert (await client.get("/v1/kv/ct")).status_code == 404


async def test_default_value_limit_is_one_mebibyte(service: InProcessService) -> None:
    transport = httpx.ASGITransport(app=create_app(service))
    async with httpx.AsyncClient(transport=transport, base_url="http://node1") as http:
        one_mib = 1024 * 1024
        assert (await http.put("/v1/kv/big", content=b"m" * one_mib)).status_code == 200
        assert_problem(await http.put("/v1/kv/big", content=b"m" * (one_mib + 1)), 413)
        got = await http.get("/v1/kv/big")
        assert len(got.content) == one_mib
