"""The client's routing and retry rules against scripted nodes (httpx.MockTransport): what
a caller sees for each answer a cluster can give, and which requests go where."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from metakv import (
    AsyncClient,
    Client,
    ClientClosed,
    Compacted,
    Conflict,
    Forbidden,
    Indeterminate,
    InvalidRequest,
    MetakvError,
    RetryPolicy,
    ServerError,
    Unavailable,
    VersionNotReached,
)
from metakv.protocol import Answer, Request, WatchCursor
from metakv.routing import Call, Endpoints

A, B, C = "http://a:1", "http://b:2", "http://c:3"
NODE_IDS = {"a": 1, "b": 2, "c": 3}
QUICK = RetryPolicy(deadline_s=0.5, backoff_base_s=0.001, backoff_max_s=0.002, retry_after_max_s=0.01)

Handler = Callable[[httpx.Request], httpx.Response]


def node_headers(request: httpx.Request, leader: str = "b", version: int = 7) -> dict[str, str]:
    return {"X-Node-Id": str(NODE_IDS[request.url.host]), "X-Raft-Leader": str(NODE_IDS[leader]),
            "X-Metadata-Version": str(version)}


def problem(status: int, slug: str, title: str, **extras: Any) -> bytes:
    return json.dumps({"type": f"urn:metakv:problem:{slug}", "title": title, "status": status,
                       "detail": f"{title} detail", **extras}).encode()


class Recorder:
    """Scripted nodes: ``handler`` answers; every request is kept in ``seen``."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.seen: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        return self.handler(request)

    def client(self, endpoints: str = f"{A},{B},{C}", **kwargs: Any) -> Client:
        return Client(endpoints, transport=httpx.MockTransport(self), **{"retry": QUICK, **kwargs})

    def hosts(self) -> list[str]:
        return [request.url.host for request in self.seen]


def leader_b(request: httpx.Request) -> httpx.Response:
    """b leads; a and c redirect writes to it; every node serves reads."""
    headers = node_headers(request)
    if request.method == "PUT" and request.url.host != "b":
        return httpx.Response(307, headers={**headers, "Location": f"{B}{request.url.raw_path.decode()}"},
                              content=problem(307, "not-leader", "Not the leader"))
    if request.method == "PUT":
        return httpx.Response(200, headers=headers, json={"key": "k", "version": 12, "created": True})
    return httpx.Response(200, headers={**headers, "ETag": '"5"', "X-Create-Version": "3",
                                        "Content-Type": "text/plain"}, content=b"v")


def test_a_write_follows_the_redirect_and_later_writes_go_straight_to_the_leader() -> None:
    nodes = Recorder(leader_b)
    with nodes.client() as kv:
        assert kv.put("k", "x").version == 12
        assert kv.put("k", "y").version == 12
    assert nodes.hosts() == ["a", "b", "b"]
    assert nodes.seen[1].content == b"x" and nodes.seen[1].headers["content-type"].startswith("text/plain")


def test_the_leader_is_learned_from_x_raft_leader_before_any_redirect() -> None:
    nodes = Recorder(leader_b)
    with nodes.client(f"{B},{A}") as kv:
        kv.get("k")  # answered by b, which names itself leader
        endpoints = kv.endpoints
        assert endpoints.leader_url == B
    endpoints = Endpoints([A, B])
    endpoints.learn(B, {"x-node-id": "2", "x-raft-leader": "1"})
    endpoints.learn(A, {"x-node-id": "1", "x-raft-leader": "1"})
    assert endpoints.leader_url == A  # b named 1 before anyone said which URL 1 is; a did


def test_reads_send_the_sessions_version_as_min_version_unless_turned_off() -> None:
    nodes = Recorder(leader_b)
    with nodes.client() as kv:
        kv.put("k", "x")  # version 12; the answer said X-Metadata-Version 7
        assert kv.get("k") is not None
        assert kv.get("k", consistency="leader") is not None
        assert kv.get("k", min_version=3) is not None
    local, leader, explicit = (request.url.params for request in nodes.seen[-3:])
    assert local["min_version"] == "12" and "consistency" not in local
    assert leader["consistency"] == "leader" and "min_version" not in leader
    assert explicit["min_version"] == "3"
    nodes.seen.clear()
    with nodes.client(read_your_writes=False) as kv:
        kv.put("k", "x")
        kv.get("k")
    assert "min_version" not in nodes.seen[-1].url.params


def test_a_refused_connection_fails_over_and_the_write_happens_once() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a":
            raise httpx.ConnectError("refused", request=request)
        return leader_b(request)
    nodes = Recorder(handler)
    with nodes.client() as kv:
        assert kv.put("k", "x").version == 12
    assert nodes.hosts() == ["a", "b"]


def test_503_waits_at_least_retry_after_then_tries_another_node() -> None:
    request = Request("GET", "/v1/kv/k")
    call = Call(request, Endpoints([A, B]), RetryPolicy(backoff_base_s=0.001, backoff_max_s=0.001))
    no_leader = Answer(503, {"retry-after": "1"}, problem(503, "no-leader", "No leader"))
    assert call.answered(no_leader) == 1.0
    assert call.url == B + "/v1/kv/k"
    capped = Call(request, Endpoints([A, B]), RetryPolicy(retry_after_max_s=0.25, backoff_max_s=0.001))
    assert capped.answered(Answer(503, {"retry-after": "30"}, b"")) == 0.25


def test_a_cluster_without_a_leader_raises_unavailable_with_the_problems_title() -> None:
    nodes = Recorder(lambda request: httpx.Response(503, headers={**node_headers(request), "Retry-After": "1"},
                                                    content=problem(503, "no-leader", "No leader")))
    with nodes.client() as kv, pytest.raises(Unavailable) as raised:
        kv.put("k", "x")
    assert raised.value.title == "No leader" and len(nodes.seen) > 2


def timeout_after_send(then: Handler) -> Handler:
    """The first request times out after it was sent; later ones get ``then``'s answer."""
    def handler(request: httpx.Request) -> httpx.Response:
        if len(calls) == 0:
            calls.append(request)
            raise httpx.ReadTimeout("timed out", request=request)
        return then(request)
    calls: list[httpx.Request] = []
    return handler


def test_an_unconditional_put_with_an_unknown_outcome_raises_indeterminate_and_is_not_resent() -> None:
    nodes = Recorder(timeout_after_send(leader_b))
    with nodes.client(B) as kv, pytest.raises(Indeterminate):
        kv.put("k", "x")
    assert len(nodes.seen) == 1
    nodes = Recorder(lambda request: httpx.Response(504, headers=node_headers(request), content=problem(
        504, "indeterminate", "Outcome unknown", indeterminate=True)))
    with nodes.client(B) as kv, pytest.raises(Indeterminate):
        kv.delete("k")
    assert len(nodes.seen) == 1


def test_a_conditional_put_with_an_unknown_outcome_is_resent_since_it_applies_at_most_once() -> None:
    nodes = Recorder(timeout_after_send(leader_b))
    with nodes.client(B) as kv:
        assert kv.put("k", "x", if_version=4).version == 12  # the retry applied it: exactly once
    assert len(nodes.seen) == 2 and nodes.seen[1].headers["if-match"] == '"4"'

    def applied_first(request: httpx.Request) -> httpx.Response:  # the retry finds the condition failed
        return httpx.Response(412, headers=node_headers(request), content=problem(
            412, "precondition-failed", "Precondition failed", current_version=12))
    nodes = Recorder(timeout_after_send(applied_first))
    with nodes.client(B) as kv, pytest.raises(Indeterminate) as raised:
        kv.put("k", "x", if_version=4)
    assert "12" in raised.value.detail  # it may have been this client's own first attempt


def test_a_create_with_an_unknown_outcome_is_not_resent() -> None:
    """"Missing" can hold again (a delete in between): a re-sent create could apply twice."""
    for write in (lambda kv: kv.create("k", "x"), lambda kv: kv.put("k", "x", if_version=0),
                  lambda kv: kv.delete("k", if_version=0)):
        nodes = Recorder(timeout_after_send(leader_b))
        with nodes.client(B) as kv, pytest.raises(Indeterminate):
            write(kv)
        assert len(nodes.seen) == 1


def test_problem_documents_become_typed_errors() -> None:
    answers = {"/v1/kv/conflict": (412, problem(412, "precondition-failed", "Precondition failed", current_version=9)),
               "/v1/kv/secret": (403, problem(403, "forbidden", "Forbidden")),
               "/v1/kv/broken": (200, b"not json")}
    nodes = Recorder(lambda request: httpx.Response(answers[request.url.path][0], headers=node_headers(request),
                                                    content=answers[request.url.path][1]))
    with nodes.client(B) as kv:
        with pytest.raises(Conflict) as conflict:
            kv.put("conflict", "x", if_version=3)
        assert conflict.value.current_version == 9 and conflict.value.title == "Precondition failed"
        with pytest.raises(Forbidden):
            kv.put("secret", "x")
        with pytest.raises(ServerError):
            kv.put("broken", "x")


def test_no_httpx_error_leaks_out() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("peer closed", request=request)
    with Recorder(handler).client(B) as kv:
        with pytest.raises(Unavailable):
            kv.get("k")
        with pytest.raises(Indeterminate):
            kv.put("k", "v")
        with pytest.raises(MetakvError):
            kv.txn().when_exists("k").then_delete("k").commit()


def test_a_watch_resumes_from_the_last_version_on_another_node_and_raises_compacted_on_410() -> None:
    script = iter([
        ("a", 200, {"version": 4, "events": [{"type": "put", "key": "p/1", "mod_version": 3, "value": "x",
                                              "content_type": "text/plain"}]}),
        ("a", None, None),  # the node dies mid-poll
        ("b", 200, {"version": 6, "events": [{"type": "delete", "key": "p/1", "mod_version": 6}]}),
        ("b", 200, {"version": 6, "events": []}),
        ("b", 410, None),
    ])

    def handler(request: httpx.Request) -> httpx.Response:
        host, status, body = next(script)
        assert request.url.host == host
        if status is None:
            raise httpx.ReadError("connection reset", request=request)
        if status == 410:
            return httpx.Response(410, headers=node_headers(request), content=problem(
                410, "version-compacted", "Version compacted", oldest_version=20))
        return httpx.Response(status, headers=node_headers(request), json=body)
    nodes = Recorder(handler)
    events = []
    with nodes.client(f"{A},{B}") as kv, pytest.raises(Compacted) as raised:
        for event in kv.watch("p/", since=2, poll_timeout_ms=100):
            events.append((event.type, event.key, event.mod_version, event.value))
    assert events == [("put", "p/1", 3, b"x"), ("delete", "p/1", 6, None)]
    assert [request.url.params["since"] for request in nodes.seen] == ["2", "4", "4", "6", "6"]
    assert raised.value.oldest_version == 20


def test_the_async_client_drives_the_same_calls() -> None:
    import asyncio

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/txn":
            body = json.loads(request.content)
            assert body["compare"] == [{"key": "k", "mod_version": 0}]
            return httpx.Response(200, headers=node_headers(request), json={
                "succeeded": False, "version": 14, "results": [{"op": "get", "key": "k", "found": True, "value": "v",
                                                                "content_type": "text/plain", "mod_version": 5,
                                                                "create_version": 3}],
                "failed_compares": [{"key": "k", "current_version": 5}]})
        return leader_b(request)
    nodes = Recorder(handler)

    async def scenario() -> None:
        async with AsyncClient(f"{A},{B}", transport=httpx.MockTransport(nodes), retry=QUICK) as kv:
            assert (await kv.put("k", "x")).version == 12
            result = await kv.txn().when_version("k", 0).then_put("k", "v").else_get("k").commit()
            assert not result.succeeded and result.results[0]["kv"].value == b"v"
            found = await kv.get("k")
            assert found is not None and (found.mod_version, found.create_version) == (5, 3)
    asyncio.run(scenario())
    assert nodes.hosts() == ["a", "b", "b", "a"]
    assert nodes.seen[-1].url.params["min_version"] == "14"


def test_a_watch_fails_over_when_its_node_dies_after_a_poll_longer_than_the_deadline() -> None:
    """A long-poll is held open for up to its timeout (30 s by default), longer than the
    deadline (15 s): retrying starts when it fails, not when it was sent. Still bounded."""
    now = [0.0]
    request = WatchCursor("p/", 5, 30_000).request()
    call = Call(request, Endpoints([A, B]), RetryPolicy(deadline_s=15.0, backoff_max_s=0.001), clock=lambda: now[0])
    now[0] = 31.0  # the poll waited 31 s, then the node died
    assert call.failed(httpx.RemoteProtocolError("Server disconnected without sending a response")) is not None
    assert call.url.startswith(B) and "since=5" in call.url
    now[0] = 47.0  # 16 s of failures since
    with pytest.raises(Unavailable):
        call.failed(httpx.ConnectError("refused"))


def test_dot_segments_of_a_key_are_sent_encoded_not_resolved() -> None:
    nodes = Recorder(leader_b)
    with nodes.client(B) as kv:
        kv.put("a/../b", "x")
        kv.put(".", "x")
        kv.get("a/./..")
    assert [request.url.raw_path.split(b"?")[0] for request in nodes.seen] == [
        b"/v1/kv/a/%2E%2E/b", b"/v1/kv/%2E", b"/v1/kv/a/%2E/%2E%2E"]


def test_input_that_cannot_be_sent_is_invalid_request_and_nothing_is_sent() -> None:
    nodes = Recorder(leader_b)
    with pytest.raises(InvalidRequest, match="Invalid token"):
        nodes.client(token="abc\nX-Injected: 1")
    with nodes.client(B) as kv:
        for bad_call in (lambda: kv.put("k", "v", content_type="text/plain\r\nX-Injected: 1"),
                         lambda: kv.put("k", "v", content_type="text/plain; name=\u00e9"),
                         lambda: kv.put("k\udcff", "v"), lambda: kv.put("k", "v\udcff"),
                         lambda: kv.list("p\udcff"), lambda: kv.get("\udcff")):
            with pytest.raises(InvalidRequest):
                bad_call()
    assert nodes.seen == []

    def refuses_locally(request: httpx.Request) -> httpx.Response:
        raise httpx.LocalProtocolError("Illegal header value")
    nodes = Recorder(refuses_locally)
    with nodes.client(B) as kv, pytest.raises(InvalidRequest):
        kv.put("k", "v")  # never sent: not Indeterminate, and not retried
    assert len(nodes.seen) == 1


def test_version_not_reached_tries_each_node_once_then_raises() -> None:
    """Each node already waited wait_ms; trying them again until the deadline only delays
    the answer (a wait_ms=100 read took the whole 15 s deadline)."""
    nodes = Recorder(lambda request: httpx.Response(504, headers=node_headers(request), content=problem(
        504, "version-not-reached", "Version not reached", current_version=7)))
    with nodes.client(retry=RetryPolicy(deadline_s=60.0, backoff_base_s=0.001, backoff_max_s=0.002)) as kv, \
            pytest.raises(VersionNotReached) as raised:
        kv.get("k", min_version=10**9, wait_ms=100)
    assert nodes.hosts() == ["a", "b", "c"] and raised.value.current_version == 7


def test_cas_loop_keeps_the_keys_content_type() -> None:
    def json_key(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, headers={**node_headers(request), "ETag": '"5"', "X-Create-Version": "3",
                                                "Content-Type": "application/json"}, content=b'{"n": 1}')
        return leader_b(request)
    nodes = Recorder(json_key)
    with nodes.client(B) as kv:
        kv.cas_loop("k", lambda value: '{"n": 2}')
        kv.cas_loop("k", lambda value: b"raw", content_type="application/octet-stream")
    put, other = (request for request in nodes.seen if request.method == "PUT")
    assert put.headers["content-type"] == "application/json" and put.headers["if-match"] == '"5"'
    assert other.headers["content-type"] == "application/octet-stream"


def test_an_endpoint_with_a_path_is_refused_not_cut_to_its_origin() -> None:
    """Requests go to /v1/... at the origin: http://proxy/metakv would be served by the proxy's root."""
    for endpoint in ("http://proxy:80/metakv", "http://a:1?x=1", "http://user:secret@a:1"):
        with pytest.raises(InvalidRequest, match="Invalid endpoint"):
            Client(endpoint)
    with Client("http://a:1/, http://b:2") as kv:
        assert kv.endpoints.urls == [A, B]


@pytest.mark.parametrize("body", [{"unexpected": [1]}, [1, 2], {"key": "k", "version": "seven"}])
def test_an_answer_that_is_not_the_apis_is_a_server_error(body: object) -> None:
    """Another server behind the URL answers 200 with other JSON: ServerError, never KeyError."""
    nodes = Recorder(lambda request: httpx.Response(200, headers={**node_headers(request), "ETag": '"1"',
                                                                  "X-Create-Version": "1"}, json=body))
    with nodes.client(B) as kv:
        for call in (lambda: kv.put("k", "v"), lambda: kv.delete("k"), kv.list, kv.txn().commit,
                     lambda: next(kv.watch("", since=1))):
            with pytest.raises(ServerError, match="Malformed answer"):
                call()
        if not isinstance(body, dict):
            with pytest.raises(ServerError):
                kv.status()


def test_a_closed_client_raises_client_closed_also_in_a_running_watch() -> None:
    """Closing the client is how another thread ends a watch: at its next poll, typed."""
    import asyncio

    def changes(request: httpx.Request) -> httpx.Response:
        since = int(request.url.params["since"])
        return httpx.Response(200, headers=node_headers(request), json={"version": since + 1, "events": [
            {"type": "delete", "key": "p/1", "mod_version": since + 1}]})
    kv = Recorder(changes).client(B)
    watch = kv.watch("p/", since=1)
    assert next(watch).mod_version == 2
    kv.close()
    with pytest.raises(ClientClosed):
        next(watch)
    with pytest.raises(ClientClosed):
        kv.get("k")

    async def scenario() -> None:
        async with AsyncClient(B, transport=httpx.MockTransport(changes), retry=QUICK) as akv:
            pass
        with pytest.raises(ClientClosed):
            await akv.put("k", "v")
    asyncio.run(scenario())


def test_a_relative_location_is_resolved_before_it_names_the_leader() -> None:
    """A proxy may rewrite Location to a path: the leader is then that same origin."""
    redirected: list[str] = []

    def proxy(request: httpx.Request) -> httpx.Response:
        if request.method == "PUT" and not redirected:
            redirected.append(request.url.host)
            return httpx.Response(307, headers={"Location": "/v1/kv/k"})
        return httpx.Response(200, json={"key": "k", "version": 12, "created": False})
    nodes = Recorder(proxy)
    with nodes.client(C) as kv:
        kv.put("k", "x")
        kv.put("k", "y")
        assert kv.endpoints.leader_url == C
    assert nodes.hosts() == ["c", "c", "c"]


def test_cas_loop_rereads_at_the_sessions_version_after_losing_to_a_delete() -> None:
    """A Conflict with current_version 0 (the key was deleted) must not drop the re-read's
    floor to nothing: a lagging node could show the deleted key again."""
    def deleted_meanwhile(request: httpx.Request) -> httpx.Response:
        if request.method == "PUT" and request.headers.get("if-match") == '"5"':
            return httpx.Response(412, headers=node_headers(request), content=problem(
                412, "precondition-failed", "Precondition failed", current_version=0))
        if request.method == "GET" and len(nodes.seen) > 1:
            return httpx.Response(404, headers=node_headers(request), content=problem(404, "key-not-found", "Key not found"))
        return leader_b(request)
    nodes = Recorder(deleted_meanwhile)
    with nodes.client(B) as kv:
        assert kv.cas_loop("k", lambda value: "fresh").version == 12
    reread = [request for request in nodes.seen if request.method == "GET"][1]
    assert reread.url.params["min_version"] == "7"  # the session's, seen in the first read's answer


def test_the_token_goes_only_to_the_listed_endpoints() -> None:
    """A redirect to a node the caller did not list is followed without the token (issue 21:
    the client keeps the Authorization header within the cluster's own URLs)."""
    elsewhere = "http://elsewhere:9"

    def redirect_elsewhere(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a":
            return httpx.Response(307, headers={"Location": f"{elsewhere}{request.url.raw_path.decode()}"},
                                  content=problem(307, "not-leader", "Not the leader"))
        return httpx.Response(200, json={"key": "k", "version": 3, "created": True})

    listed = Recorder(leader_b)
    with listed.client(token="s3cret") as kv:
        kv.put("k", "x")  # a redirects to b, which was listed: the token goes along
    assert listed.hosts() == ["a", "b"]
    assert all(request.headers["authorization"] == "Bearer s3cret" for request in listed.seen)
    unlisted = Recorder(redirect_elsewhere)
    with unlisted.client(A, token="s3cret") as kv:
        kv.put("k", "x")
    assert unlisted.hosts() == ["a", "elsewhere"]
    assert unlisted.seen[0].headers["authorization"] == "Bearer s3cret"
    assert "authorization" not in unlisted.seen[1].headers


def test_a_redirect_from_https_to_http_is_not_followed() -> None:
    secure = "https://a:1"

    def downgrade(request: httpx.Request) -> httpx.Response:
        return httpx.Response(307, headers={"Location": f"http://a:1{request.url.raw_path.decode()}"},
                              content=problem(307, "not-leader", "Not the leader"))

    nodes = Recorder(downgrade)
    with nodes.client(secure, token="s3cret") as kv, pytest.raises(Unavailable, match="redirect from https"):
        kv.put("k", "x")
    assert {request.url.scheme for request in nodes.seen} == {"https"}
