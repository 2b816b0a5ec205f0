"""The voter routes (app/http/voters.py) over the in-process service: what each refusal of
the service answers, the body and path checks, and what reaches the service."""

from __future__ import annotations

import httpx
import pytest

from app.auth import Access, AuthPolicy, AuthTokens, Token, hash_token
from app.http import create_app
from app.service import (
    NewVoter,
    NotLeaderError,
    VoterChangeIndeterminateError,
    VoterChangeRefusedError,
    VoterSetView,
)
from tests.http.conftest import TEST_SETTINGS
from tests.http.service_double import InProcessService

pytestmark = pytest.mark.anyio

DIRECTORY = "0123456789abcdef0123456789abcdef"
NEW_SET: VoterSetView = {"kraft_version": 1, "pending_change": None, "voters": [
    {"node_id": 1, "directory_id": DIRECTORY, "raft_endpoint": "127.0.0.1:9001", "http_url": "http://n1"},
    {"node_id": 2, "directory_id": "f" * 32, "raft_endpoint": "127.0.0.1:9002", "http_url": "http://n2"}]}


async def test_a_static_node_refuses_every_change_with_409(client: httpx.AsyncClient) -> None:
    for response in (await client.post("/v1/admin/voters", json={"id": 2}), await client.delete("/v1/admin/voters/2")):
        assert response.status_code == 409
        assert response.headers["content-type"] == "application/problem+json"
        assert response.json()["type"] == "urn:metakv:problem:kraft-version-0"
        assert response.json()["title"] == "Voter change refused"


@pytest.mark.parametrize(("code", "status"), [
    ("change-pending", 409), ("already-voter", 409), ("not-caught-up", 409), ("last-voter", 409),
    ("unknown-voter", 404), ("leader-not-ready", 503), ("raft-endpoint-unknown", 422)])
async def test_each_refusal_has_its_status(client: httpx.AsyncClient, service: InProcessService, code: str,
                                           status: int, monkeypatch: pytest.MonkeyPatch) -> None:
    async def refuse(*args: object) -> VoterSetView:
        raise VoterChangeRefusedError(code, f"refused: {code}")
    monkeypatch.setattr(service, "add_voter", refuse)
    monkeypatch.setattr(service, "remove_voter", refuse)
    for response in (await client.post("/v1/admin/voters", json={"id": 3}), await client.delete("/v1/admin/voters/3")):
        assert response.status_code == status
        problem = response.json()
        assert (problem["type"], problem["status"]) == (f"urn:metakv:problem:{code}", status)
        assert f"refused: {code}" in problem["detail"]
        assert ("retry-after" in response.headers) == (status == 503)


async def test_the_request_reaches_the_service_and_the_new_set_comes_back(
        client: httpx.AsyncClient, service: InProcessService, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[object] = []

    async def add(voter: NewVoter) -> VoterSetView:
        asked.append(voter)
        return NEW_SET

    async def remove(node_id: int, directory_id: str | None = None) -> VoterSetView:
        asked.append((node_id, directory_id))
        return NEW_SET
    monkeypatch.setattr(service, "add_voter", add)
    monkeypatch.setattr(service, "remove_voter", remove)
    response = await client.post("/v1/admin/voters", json={"id": 2, "directory_id": "f" * 32,
                                                          "raft_endpoint": "[::1]:9002"})
    assert (response.status_code, response.json()) == (200, NEW_SET)
    assert (await client.post("/v1/admin/voters", json={"id": 2})).status_code == 200
    response = await client.delete(f"/v1/admin/voters/3?directory_id={DIRECTORY}")
    assert (response.status_code, response.json()) == (200, NEW_SET)
    assert asked == [NewVoter(2, "f" * 32, "[::1]:9002", None), NewVoter(2), (3, DIRECTORY)]


async def test_bad_input_is_refused_before_the_service(
        client: httpx.AsyncClient, service: InProcessService, monkeypatch: pytest.MonkeyPatch) -> None:
    async def unexpected(*args: object) -> VoterSetView:
        raise AssertionError("bad input reached the service")
    monkeypatch.setattr(service, "add_voter", unexpected)
    monkeypatch.setattr(service, "remove_voter", unexpected)
    for body in ({}, {"id": -1}, {"id": "two"}, {"id": 2, "directory_id": "ABC"}, {"id": 2, "raft_endpoint": "nohost"},
                 {"id": 2, "http_url": "ftp://x"}, {"id": 2, "extra": 1}, [2]):
        response = await client.post("/v1/admin/voters", json=body)
        assert (response.status_code, response.json()["type"]) == (422, "urn:metakv:problem:invalid-body"), body
    response = await client.post("/v1/admin/voters", content=b"{not json")
    assert response.status_code == 422
    for path in ("/v1/admin/voters/x", "/v1/admin/voters/-1", "/v1/admin/voters/1?directory_id=zz"):
        response = await client.delete(path)
        assert (response.status_code, response.json()["type"]) == (400, "urn:metakv:problem:invalid-parameter"), path


async def test_a_follower_redirects_and_an_unknown_outcome_is_504(
        client: httpx.AsyncClient, service: InProcessService, monkeypatch: pytest.MonkeyPatch) -> None:
    async def not_leader(*args: object) -> VoterSetView:
        raise NotLeaderError("http://leader:8002", 2)

    async def unknown(*args: object) -> VoterSetView:
        raise VoterChangeIndeterminateError("the voters record at 9 was not committed; look at the voter set")
    monkeypatch.setattr(service, "add_voter", not_leader)
    response = await client.post("/v1/admin/voters", json={"id": 3})
    assert (response.status_code, response.headers["location"]) == (307, "http://leader:8002/v1/admin/voters")
    monkeypatch.setattr(service, "remove_voter", unknown)
    response = await client.delete("/v1/admin/voters/3")
    assert response.status_code == 504
    assert response.json()["indeterminate"] is True and "voter set" in response.json()["detail"]


async def test_with_auth_on_only_an_admin_token_changes_voters(service: InProcessService) -> None:
    service.auth_tokens = AuthTokens(AuthPolicy("inline", (
        Token("writer", hash_token("w"), (("", Access.WRITE),)), Token("admin", hash_token("a"), (("", Access.ADMIN),)))))
    transport = httpx.ASGITransport(app=create_app(service, TEST_SETTINGS))
    async with httpx.AsyncClient(transport=transport, base_url="http://node1") as http:
        for headers, status in (({}, 401), ({"Authorization": "Bearer w"}, 403), ({"Authorization": "Bearer a"}, 409)):
            assert (await http.post("/v1/admin/voters", json={"id": 2}, headers=headers)).status_code == status
            assert (await http.delete("/v1/admin/voters/2", headers=headers)).status_code == status
