"""List, txn and watch (long-poll and SSE) as a client sees them."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from app.http import create_app
from storage.commands import put
from tests.http.conftest import TEST_SETTINGS
from tests.http.service_double import InProcessService
from tests.http.test_keys import assert_node_headers, assert_problem

pytestmark = pytest.mark.anyio


# ---- list ------------------------------------------------------------------------------------


async def test_list_renders_text_as_strings_and_binary_as_base64(client: httpx.AsyncClient) -> None:
    await client.put("/v1/kv/app/json", content=b'{"a":1}', headers={"content-type": "application/json"})
    await client.put("/v1/kv/app/bin", content=b"\xff\x00", headers={"content-type": "application/octet-stream"})
    await client.put("/v1/kv/app/bad-text", content=b"\xff", headers={"content-type": "text/plain"})
    await client.put("/v1/kv/other", content=b"x")
    listed = await client.get("/v1/kv", params={"prefix": "app/"})
    assert listed.status_code == 200
    assert_node_headers(listed, version=4)
    body = listed.json()
    assert body["version"] == 4 and body["next"] is None
    assert body["items"] == [
        {"key": "app/bad-text", "value": "/w==", "encoding": "base64", "content_type": "text/plain",
         "mod_version": 3, "create_version": 3, "key_version": 1},
        {"key": "app/bin", "value": base64.b64encode(b"\xff\x00").decode(), "encoding": "base64",
         "content_type": "application/octet-stream", "mod_version": 2, "create_version": 2, "key_version": 1},
        {"key": "app/json", "value": '{"a":1}', "content_type": "application/json", "mod_version": 1,
         "create_version": 1, "key_version": 1},
    ]


async def test_list_body_is_compact_utf8_json_with_non_ascii_unescaped(client: httpx.AsyncClient) -> None:
    await client.put("/v1/kv/ü/ключ", content="значение \"q\"\n".encode(), headers={"content-type": "text/plain; charset=utf-8"})
    await client.put("/v1/kv/ü/b", content=b"\x00\x01", headers={"content-type": "application/octet-stream"})
    listed = await client.get("/v1/kv", params={"prefix": "ü/"})
    assert listed.status_code == 200 and listed.headers["content-type"] == "application/json"
    # The bytes a client gets: no whitespace, non-ASCII as UTF-8 (not \u escapes), as documented.
    assert listed.content == json.dumps(listed.json(), ensure_ascii=False, separators=(",", ":")).encode()
    assert "ключ".encode() in listed.content and "значение".encode() in listed.content
    assert [item["key"] for item in listed.json()["items"]] == ["ü/b", "ü/ключ"]


async def test_list_pages_with_after_and_next_at_one_version(client: httpx.AsyncClient) -> None:
    for index in range(5):
        await client.put(f"/v1/kv/p/{index}", content=str(index).encode(), headers={"content-type": "text/plain"})
    first = (await client.get("/v1/kv", params={"prefix": "p/", "limit": 2})).json()
    assert [item["key"] for item in first["items"]] == ["p/0", "p/1"] and first["next"] == "p/1"
    await client.delete("/v1/kv/p/3")  # a change between pages must not show in a pinned listing
    second = (await client.get("/v1/kv", params={"prefix": "p/", "limit": 2, "after": first["next"],
                                                 "at_version": first["version"]})).json()
    assert [item["key"] for item in second["items"]] == ["p/2", "p/3"]
    third = (await client.get("/v1/kv", params={"prefix": "p/", "limit": 2, "after": second["next"],
                                                "at_version": first["version"]})).json()
    assert [item["key"] for item in third["items"]] == ["p/4"] and third["next"] is None
    latest = (await client.get("/v1/kv", params={"prefix": "p/"})).json()
    assert [item["key"] for item in latest["items"]] == ["p/0", "p/1", "p/2", "p/4"]


async def test_list_keys_only_leaves_values_out(client: httpx.AsyncClient) -> None:
    await client.put("/v1/kv/k1", content=b"secret", headers={"content-type": "text/plain"})
    items = (await client.get("/v1/kv", params={"keys_only": "true"})).json()["items"]
    assert items == [{"key": "k1", "content_type": "text/plain", "mod_version": 1, "create_version": 1,
                      "key_version": 1}]


async def test_list_bad_parameters_are_400(client: httpx.AsyncClient) -> None:
    assert_problem(await client.get("/v1/kv", params={"limit": 0}), 400)
    assert_problem(await client.get("/v1/kv", params={"limit": 100000}), 400)
    assert_problem(await client.get("/v1/kv", params={"at_version": 2**63}), 400)
    assert_problem(await client.get("/v1/kv", params={"keys_only": "perhaps"}), 400)


async def test_list_prefix_no_key_can_have_lists_nothing(client: httpx.AsyncClient) -> None:
    await client.put("/v1/kv/a", content=b"v")
    for prefix in ("a\x00", "a" * 2000):
        response = await client.get("/v1/kv", params={"prefix": prefix})
        assert response.status_code == 200
        assert response.json() == {"version": 1, "items": [], "next": None}


async def test_list_below_horizon_is_410(client: httpx.AsyncClient, service: InProcessService) -> None:
    for index in range(3):
        await client.put(f"/v1/kv/x{index}", content=b"v")
    service.state.prune_history(3)
    document = assert_problem(await client.get("/v1/kv", params={"at_version": 1}), 410)
    assert document["oldest_version"] == 3


# ---- txn -------------------------------------------------------------------------------------


async def test_txn_success_branch_is_one_version(client: httpx.AsyncClient) -> None:
    await client.put("/v1/kv/acct/a", content=b"10", headers={"content-type": "text/plain"})
    response = await client.post("/v1/txn", json={
        "compare": [{"key": "acct/a", "mod_version": 1}, {"key": "acct/b", "exists": False},
                    {"key": "acct/a", "value": "10"}],
        "success": [{"op": "put", "key": "acct/a", "value": "5", "content_type": "text/plain"},
                    {"op": "put", "key": "acct/b", "value": base64.b64encode(b"\x05").decode(), "encoding": "base64"},
                    {"op": "get", "key": "acct/a"}],
        "failure": [{"op": "delete", "key": "acct/a"}],
    })
    assert response.status_code == 200, response.text
    assert_node_headers(response, version=2)
    body = response.json()
    assert body["succeeded"] is True and body["version"] == 2 and body["failed_compares"] == []
    assert body["results"] == [
        {"op": "put", "key": "acct/a", "created": False},
        {"op": "put", "key": "acct/b", "created": True},
        {"op": "get", "key": "acct/a", "found": True, "value": "5", "content_type": "text/plain",
         "mod_version": 2, "create_version": 1, "key_version": 2},
    ]
    assert (await client.get("/v1/kv/acct/b")).content == b"\x05"
    assert (await client.get("/v1/kv/acct/b")).headers["etag"] == '"2"'


async def test_txn_failure_branch_reports_failed_compares(client: httpx.AsyncClient) -> None:
    await client.put("/v1/kv/lock", content=b"held")
    response = await client.post("/v1/txn", json={
        "compare": [{"key": "lock", "exists": False}],
        "success": [{"op": "put", "key": "lock", "value": "mine"}],
        "failure": [{"op": "get", "key": "lock"}, {"op": "get", "key": "missing"}],
    })
    body = response.json()
    assert response.status_code == 200
    assert body["succeeded"] is False and body["version"] == 2
    assert body["failed_compares"] == [{"key": "lock", "current_version": 1}]
    assert body["results"][0]["found"] is True and body["results"][0]["encoding"] == "base64"
    assert base64.b64decode(body["results"][0]["value"]) == b"held"
    assert body["results"][1] == {"op": "get", "key": "missing", "found": False}
    assert (await client.get("/v1/kv/lock")).content == b"held"


@pytest.mark.parametrize("body", [
    b"{not json",
    b"[]",
    b'{"success": [{"op": "rename", "key": "a"}]}',
    b'{"success": [{"op": "put"}]}',
    b'{"compare": [{"key": "a", "mod_version": 1, "exists": true}]}',
    b'{"compare": [{"key": "a", "mod_version": "1"}]}',
    b'{"success": [{"op": "put", "key": "a", "value": "%%%", "encoding": "base64"}]}',
    b'{"success": [{"op": "put", "key": "", "value": "x"}]}',
    b'{"success": [{"op": "put", "key": "a\\u0000b", "value": "x"}]}',
    b'{"success": [{"op": "put", "key": "\\ud800", "value": "x"}]}',
    b'{"unknown": 1}',
])
async def test_malformed_txn_is_422_problem_and_writes_nothing(client: httpx.AsyncClient, service: InProcessService,
                                                               body: bytes) -> None:
    response = await client.post("/v1/txn", content=body, headers={"content-type": "application/json"})
    document = assert_problem(response, 422)
    assert document["errors"]
    assert service.proposals == 0


async def test_txn_too_many_ops_is_422(client: httpx.AsyncClient, service: InProcessService) -> None:
    ops = [{"op": "delete", "key": f"k{index}"} for index in range(129)]
    assert_problem(await client.post("/v1/txn", json={"success": ops}), 422)
    assert service.proposals == 0


async def test_txn_value_and_body_size_limits_are_413(client: httpx.AsyncClient, service: InProcessService) -> None:
    too_big_value = "v" * (TEST_SETTINGS.max_value_bytes + 1)
    assert_problem(await client.post("/v1/txn", json={"success": [{"op": "put", "key": "a", "value": too_big_value}]}), 413)
    huge = [{"op": "put", "key": f"k{index}", "value": "v" * 4000} for index in range(20)]
    assert_problem(await client.post("/v1/txn", json={"success": huge}), 413)
    assert service.proposals == 0


@pytest.mark.parametrize("too_large", ["k" * 1025, "é" * 600, "é" * 512 + "a"])
@pytest.mark.parametrize("place", ["put", "delete", "get", "compare", "failure"])
async def test_txn_key_over_1024_bytes_is_413_key_too_large_like_the_key_routes(
        client: httpx.AsyncClient, service: InProcessService, too_large: str, place: str) -> None:
    body = {
        "put": {"success": [{"op": "put", "key": too_large, "value": "x"}]},
        "delete": {"success": [{"op": "delete", "key": too_large}]},
        "get": {"success": [{"op": "get", "key": too_large}]},
        "compare": {"compare": [{"key": too_large, "mod_version": 0}], "success": [{"op": "put", "key": "a"}]},
        "failure": {"failure": [{"op": "put", "key": too_large, "value": "x", "encoding": "utf-8"}]},
    }[place]
    txn_document = assert_problem(await client.post("/v1/txn", json=body), 413)
    key_document = assert_problem(await client.get("/v1/kv/" + quote(too_large)), 413)
    assert txn_document["type"] == key_document["type"] == "urn:metakv:problem:key-too-large"
    assert txn_document["title"] == key_document["title"]
    size = len(too_large.encode())
    assert f"{size} bytes" in txn_document["detail"] and "1024" in txn_document["detail"]
    assert service.proposals == 0


async def test_txn_key_of_exactly_1024_bytes_is_accepted(client: httpx.AsyncClient) -> None:
    largest = "é" * 512
    response = await client.post("/v1/txn", json={"success": [{"op": "put", "key": largest, "value": "x"}]})
    assert response.status_code == 200 and response.json()["succeeded"] is True
    assert (await client.get("/v1/kv/" + quote(largest))).content == b"x"


# ---- watch (long-poll) -----------------------------------------------------------------------


async def test_watch_returns_changes_after_since_including_deletes(client: httpx.AsyncClient) -> None:
    await client.put("/v1/kv/w/a", content=b"1", headers={"content-type": "text/plain"})
    await client.put("/v1/kv/elsewhere", content=b"x")
    await client.delete("/v1/kv/w/a")
    response = await client.get("/v1/watch", params={"prefix": "w/", "since": 0, "timeout_ms": 0})
    assert response.status_code == 200
    assert_node_headers(response, version=3)
    assert response.json() == {"version": 3, "events": [
        {"type": "put", "key": "w/a", "mod_version": 1, "value": "1", "content_type": "text/plain"},
        {"type": "delete", "key": "w/a", "mod_version": 3},
    ]}


async def test_watch_times_out_with_empty_list_and_current_version(client: httpx.AsyncClient) -> None:
    await client.put("/v1/kv/w", content=b"1")
    response = await client.get("/v1/watch", params={"since": 1, "timeout_ms": 20})
    assert response.json() == {"version": 1, "events": []}


async def test_watch_long_poll_answers_when_a_change_arrives(client: httpx.AsyncClient,
                                                             service: InProcessService) -> None:
    watcher = asyncio.create_task(client.get("/v1/watch", params={"prefix": "job/", "since": 0, "timeout_ms": 2000}))
    await service.until_waiting()
    await client.put("/v1/kv/unrelated", content=b"x")
    await client.put("/v1/kv/job/1", content=b"go", headers={"content-type": "text/plain"})
    response = await asyncio.wait_for(watcher, 10)
    events = response.json()["events"]
    assert [(event["key"], event["mod_version"]) for event in events] == [("job/1", 2)]


async def test_watch_pages_have_no_gaps(client: httpx.AsyncClient) -> None:
    """More changes than one answer holds (watch_events_max=5); a txn's events stay together
    (so a page may exceed the bound by the rest of one version)."""
    expected: list[tuple[str, int]] = []
    for index in range(4):
        response = await client.put(f"/v1/kv/g/{index}", content=b"v")
        expected.append((f"g/{index}", response.json()["version"]))
    txn = await client.post("/v1/txn", json={"success": [{"op": "put", "key": f"g/t{index}", "value": "v"} for index in range(3)]})
    expected += [(f"g/t{index}", txn.json()["version"]) for index in range(3)]
    for index in range(4):
        response = await client.delete(f"/v1/kv/g/{index}")
        expected.append((f"g/{index}", response.json()["version"]))
    seen: list[tuple[str, int]] = []
    since = 0
    pages = 0
    for _ in range(10):
        body = (await client.get("/v1/watch", params={"prefix": "g/", "since": since, "timeout_ms": 0})).json()
        if not body["events"]:
            break
        pages += 1
        seen += [(event["key"], event["mod_version"]) for event in body["events"]]
        since = body["version"]
    assert seen == expected
    assert pages >= 2


async def test_watch_below_horizon_is_410(client: httpx.AsyncClient, service: InProcessService) -> None:
    for index in range(3):
        await client.put(f"/v1/kv/h{index}", content=b"v")
    service.state.prune_history(2)
    document = assert_problem(await client.get("/v1/watch", params={"since": 1, "timeout_ms": 0}), 410)
    assert document["oldest_version"] == 2
    sse = await client.get("/v1/watch", params={"since": 0, "timeout_ms": 0}, headers={"accept": "text/event-stream"})
    assert_problem(sse, 410)


async def _quiet_prefix_while_the_horizon_passes(client: httpx.AsyncClient, service: InProcessService) -> None:
    """With a watch of ``quiet/`` from version 1 parked: other keys change, the history
    horizon passes version 1, more changes, then one under ``quiet/`` at version 4."""
    await service.until_waits_started(1)
    await client.put("/v1/kv/busy", content=b"1")  # v2
    service.state.prune_history(2)  # the cleaner moved the horizon past the watch's since
    await client.put("/v1/kv/busy", content=b"2")  # v3
    await client.put("/v1/kv/quiet/a", content=b"x", headers={"content-type": "text/plain"})  # v4


async def test_a_watch_of_a_quiet_prefix_outlives_the_horizon_passing_its_since(
        client: httpx.AsyncClient, service: InProcessService) -> None:
    """No change under the prefix is skipped, and none happened below the horizon: the watch
    must go on, not answer 410 (which a client would meet again after re-listing)."""
    await client.put("/v1/kv/busy", content=b"0")  # v1
    watcher = asyncio.create_task(client.get("/v1/watch", params={"prefix": "quiet/", "since": 1, "timeout_ms": 2000}))
    await _quiet_prefix_while_the_horizon_passes(client, service)
    response = await asyncio.wait_for(watcher, 10)
    assert response.status_code == 200, response.text
    assert [(e["key"], e["mod_version"]) for e in response.json()["events"]] == [("quiet/a", 4)]
    assert service.waits_started == 1  # the changes of other keys never woke it


async def test_changes_wake_only_the_watches_of_their_prefixes(client: httpx.AsyncClient,
                                                              service: InProcessService) -> None:
    """Apply hands each change to the watches whose prefix it falls under; the others stay
    parked (each used to wake on every applied batch and query history again)."""
    watches = {prefix: asyncio.create_task(client.get("/v1/watch", params={"prefix": prefix, "timeout_ms": 2000}))
               for prefix in ("a/", "b/", "a/x")}
    await service.until_waiting(3)
    for index in range(5):
        await client.put(f"/v1/kv/c/{index}", content=b"v")  # v1..v5: under no watched prefix
    await client.put("/v1/kv/b/1", content=b"v")  # v6
    answer = (await asyncio.wait_for(watches.pop("b/"), 10)).json()
    assert answer == {"version": 6, "events": [{"type": "put", "key": "b/1", "mod_version": 6, "value": "dg==",
                                                "encoding": "base64", "content_type": "application/octet-stream"}]}
    assert service.waits_started == 3 and service.waiting == 2  # nobody else woke
    await client.put("/v1/kv/a/xy", content=b"v")  # v7: under a/ and a/x
    answers = [(await asyncio.wait_for(task, 10)).json() for task in watches.values()]
    assert [[(e["key"], e["mod_version"]) for e in a["events"]] for a in answers] == [[("a/xy", 7)]] * 2


async def test_an_sse_watch_of_a_quiet_prefix_outlives_the_horizon_passing_its_since(
        client: httpx.AsyncClient, service: InProcessService) -> None:
    await client.put("/v1/kv/busy", content=b"0")  # v1
    stream = asyncio.create_task(client.get("/v1/watch", params={"prefix": "quiet/", "since": 1, "timeout_ms": 1000},
                                            headers={"accept": "text/event-stream"}))
    await _quiet_prefix_while_the_horizon_passes(client, service)
    response = await asyncio.wait_for(stream, 10)
    messages = parse_sse(response.text)
    assert [m["event"] for m in messages] == ["put"], response.text
    assert json.loads(messages[0]["data"])["key"] == "quiet/a"


def _last_sse_id(text: str) -> str | None:
    last = None
    for block in text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("id: "):
                last = line[4:]
    return last


async def test_an_sse_client_of_a_quiet_prefix_reconnects_without_410(
        client: httpx.AsyncClient, service: InProcessService) -> None:
    """An id with no data moves the client's Last-Event-ID while the prefix is quiet, so the
    reconnect after the stream's end resumes past versions the horizon may since have passed."""
    await client.put("/v1/kv/quiet/a", content=b"0")  # v1
    stream = asyncio.create_task(client.get("/v1/watch", params={"prefix": "quiet/", "since": 1, "timeout_ms": 800},
                                            headers={"accept": "text/event-stream"}))
    await service.until_waits_started(1)
    for index in range(3):  # other keys change while the stream is open
        await client.put("/v1/kv/busy", content=b"%d" % index)  # v2..v4
    response = await asyncio.wait_for(stream, 10)
    assert parse_sse(response.text) == [], response.text  # no event: the prefix was quiet
    resume = _last_sse_id(response.text) or "1"  # what an EventSource sends back: its last id, else since
    service.state.prune_history(4)  # the horizon passes the stream's first since
    again = await client.get("/v1/watch", params={"prefix": "quiet/", "timeout_ms": 0},
                             headers={"accept": "text/event-stream", "last-event-id": resume})
    assert again.status_code == 200, (resume, again.text)


async def test_an_sse_stream_sends_keepalives_only_at_the_keepalive_interval(client: httpx.AsyncClient) -> None:
    """A 500 ms stream with keepalives every 200 ms (TEST_SETTINGS) carries at most two; the
    last sub-millisecond of a stream once spun, sending a keepalive per turn (50-200)."""
    for _ in range(3):
        response = await client.get("/v1/watch", params={"prefix": "none/", "timeout_ms": 500},
                                    headers={"accept": "text/event-stream"})
        assert response.status_code == 200
        assert response.text.count(": keepalive") <= 2, response.text


@pytest.mark.parametrize("last_event_id", [b"\xb2", b"\xb9", b"99999999999999999999999", b"9223372036854775808",
                                           b"-1", b""])
async def test_sse_last_event_id_outside_the_version_range_is_400(client: httpx.AsyncClient, last_event_id: bytes) -> None:
    """Latin-1 superscript digits ("\u00b2" passed str.isdigit, then int() raised: a 500) and
    numbers past the largest version are refused like a bad since."""
    response = await client.get("/v1/watch", params={"timeout_ms": 0},
                                headers={"accept": "text/event-stream", "last-event-id": last_event_id})
    assert_problem(response, 400)


async def test_watch_bad_parameters_are_400(client: httpx.AsyncClient) -> None:
    assert_problem(await client.get("/v1/watch", params={"since": -1}), 400)
    assert_problem(await client.get("/v1/watch", params={"timeout_ms": "long"}), 400)
    assert_problem(await client.get("/v1/watch", params={"since": 2**63}), 400)


# ---- watch (SSE) -----------------------------------------------------------------------------


def parse_sse(text: str) -> list[dict[str, str]]:
    messages = []
    for block in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            if line and not line.startswith(":"):
                name, _, value = line.partition(": ")
                fields[name] = value
        if "data" in fields:
            messages.append(fields)
    return messages


async def test_sse_streams_events_and_resumes_from_last_event_id_without_gaps(client: httpx.AsyncClient) -> None:
    versions = []
    for index in range(7):  # more than one read's worth (watch_events_max=5)
        versions.append((await client.put(f"/v1/kv/s/{index}", content=b"v")).json()["version"])
    response = await client.get("/v1/watch", params={"prefix": "s/", "since": 2, "timeout_ms": 100},
                                headers={"accept": "text/event-stream"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert_node_headers(response)
    messages = parse_sse(response.text)
    assert [json.loads(m["data"])["mod_version"] for m in messages] == versions[2:]
    assert all(m["event"] == "put" for m in messages)
    last_id = [m["id"] for m in messages if "id" in m][-1]
    assert last_id == str(versions[-1])

    await client.delete("/v1/kv/s/0")
    resumed = await client.get("/v1/watch", params={"prefix": "s/", "timeout_ms": 50},
                               headers={"accept": "text/event-stream", "last-event-id": last_id})
    events = [json.loads(m["data"]) for m in parse_sse(resumed.text)]
    assert events == [{"type": "delete", "key": "s/0", "mod_version": versions[-1] + 1}]


async def test_sse_txn_events_share_one_resume_id(client: httpx.AsyncClient) -> None:
    txn = await client.post("/v1/txn", json={"success": [{"op": "put", "key": f"t/{i}", "value": "v"} for i in range(3)]})
    response = await client.get("/v1/watch", params={"prefix": "t/", "timeout_ms": 50},
                                headers={"accept": "text/event-stream"})
    messages = parse_sse(response.text)
    assert len(messages) == 3
    assert [m.get("id") for m in messages] == [None, None, str(txn.json()["version"])]


async def test_sse_bad_last_event_id_is_400(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/watch", headers={"accept": "text/event-stream", "last-event-id": "yesterday"})
    assert_problem(response, 400)


@pytest.mark.parametrize("content_type", ["text/\U00011606", "`", "text/plain\n", "text/plain; x"])
async def test_txn_content_type_must_be_a_media_type(client: httpx.AsyncClient, service: InProcessService,
                                                    content_type: str) -> None:
    body = {"success": [{"op": "put", "key": "a", "value": "x", "content_type": content_type}]}
    assert_problem(await client.post("/v1/txn", json=body), 422)
    assert service.proposals == 0


async def _sse_with_a_queue_of_two(tmp_path: Path, writes: list[int], prune_to: int | None) -> str:
    """An SSE watch of ``e/`` from version 1 on a node whose watches queue at most two
    events; ``writes`` puts arrive together (each count in one go, then the stream runs),
    the horizon then moved to ``prune_to``; the stream's text."""
    node = InProcessService(str(tmp_path / "state.db"), str(tmp_path / "snapshots"), watch_queue_events=2)
    try:
        transport = httpx.ASGITransport(app=create_app(node, TEST_SETTINGS))
        async with httpx.AsyncClient(transport=transport, base_url="http://node1") as client:
            await client.put("/v1/kv/e/0", content=b"v")  # v1
            stream = asyncio.create_task(client.get(
                "/v1/watch", params={"prefix": "e/", "since": 1, "timeout_ms": 500},
                headers={"accept": "text/event-stream"}))
            parks = 0
            for count in writes:
                await node.until_waits_started(parks + 1)  # the stream sent all before and waits
                parks = node.waits_started
                for _ in range(count):  # no await between them: the stream cannot read meanwhile
                    node.apply_now(put(f"e/{node.state.applied_version}", b"v"))
                if prune_to is not None:
                    node.state.prune_history(prune_to)
            response = await asyncio.wait_for(stream, 10)
            assert response.status_code == 200
            return response.text
    finally:
        node.close()


async def test_sse_watch_that_overflowed_catches_up_without_gaps(tmp_path: Path) -> None:
    """More changes at once than a watch may queue: it drops them and catches up from the
    history, then goes on live; the client sees every change once, in order."""
    text = await _sse_with_a_queue_of_two(tmp_path, [5, 1, 3], prune_to=None)
    versions = [json.loads(m["data"])["mod_version"] for m in parse_sse(text)]
    assert versions == list(range(2, 11)), text


async def test_sse_watch_that_fell_behind_the_horizon_ends_with_an_error_event(tmp_path: Path) -> None:
    """A watch whose queue overflowed catches up from history; when the horizon passed what
    it had sent (version 1) meanwhile, the 410 travels as an event and the stream ends."""
    text = await _sse_with_a_queue_of_two(tmp_path, [3], prune_to=3)
    errors = [m for m in parse_sse(text) if m.get("event") == "error"]
    assert errors, text
    problem = json.loads(errors[-1]["data"])
    assert problem["status"] == 410 and problem["oldest_version"] == 3
