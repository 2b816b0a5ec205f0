"""The dashboard's server side without a browser, over the in-process single node: which
pages each ``--ui`` mode serves, the security headers, what is open and what needs a token,
the escaping of user data in the page shells, and the cluster view's choice of leader."""

from __future__ import annotations

import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.auth import AuthTokens, hash_token, load_auth_policy
from app.http import create_app
from app.ui.cluster_view import describe, leader_of
from tests.app.test_cli_validation import refused, serve_args  # noqa: F401  (refused is a fixture)
from tests.http.service_double import InProcessService

pytestmark = pytest.mark.anyio
XSS_KEY = "<img src=x onerror=alert(1)>/\"quoted\" & 'single'"
PAGES = ["/ui", "/ui/keys?prefix=a/b/", "/ui/keys/a/b", "/ui/watch?prefix=a/", "/ui/leases"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def service(tmp_path: Path) -> Any:
    node = InProcessService(str(tmp_path / "state.db"), str(tmp_path / "snapshots"))
    try:
        yield node
    finally:
        node.close()


def client_for(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node1")


@pytest.fixture
async def client(service: InProcessService) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(create_app(service)) as http:
        yield http


async def test_every_page_is_served_with_a_strict_policy_and_only_vendored_assets(client: httpx.AsyncClient) -> None:
    for path in PAGES:
        response = await client.get(path)
        assert response.status_code == 200, path
        policy = response.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "connect-src 'self'" in policy and "unsafe" not in policy
        assert "<script>" not in response.text and " style=" not in response.text  # nothing inline
        for asset in ("/ui/static/common.js", "/ui/static/ui.css"):
            assert asset in response.text
    for name in ("common.js", "cluster.js", "chart.js", "keys.js", "key.js", "watch.js", "leases.js", "ui.css"):
        asset = await client.get(f"/ui/static/{name}")
        assert asset.status_code == 200 and asset.content, name
        text = asset.text.replace("http://www.w3.org/2000/svg", "")  # SVG's namespace name, not fetched
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, name
    missing = await client.get("/ui/static/..%2F..%2Fpages.py")
    assert missing.status_code == 404 and missing.headers["content-type"] == "application/problem+json"


async def test_a_key_in_the_url_is_escaped_in_the_page(client: httpx.AsyncClient) -> None:
    response = await client.get("/ui/keys/" + urllib.parse.quote(XSS_KEY, safe="/"))
    assert response.status_code == 200
    assert "<img" not in response.text
    assert "&lt;img src=x onerror=alert(1)&gt;/&#34;quoted&#34; &amp; &#39;single&#39;" in response.text
    page = await client.get("/ui/keys", params={"prefix": '"><script>alert(1)</script>'})
    assert "<script>alert" not in page.text and "&lt;script&gt;alert(1)" in page.text
    for path in ("/ui/keys/%FF", "/ui/keys/a%00b"):  # not UTF-8, NUL: no page for it
        answer = await client.get(path)
        assert answer.status_code == 400 and answer.json()["type"] == "urn:metakv:problem:invalid-key", path


async def test_each_page_has_a_title_naming_what_it_shows(client: httpx.AsyncClient,
                                                         service: InProcessService) -> None:
    """Tabs of a whole-store listing and feed were titled "keys  · node 1" (nothing named)."""
    titles = {"/ui": "cluster", "/ui/keys": "keys (root)", "/ui/keys?prefix=a/": "keys a/",
              "/ui/watch": "watch (root)", "/ui/watch?prefix=a/": "watch a/", "/ui/keys/a/b": "key a/b",
              "/ui/leases": "leases"}
    for path, title in titles.items():
        assert f"<title>metakv · {title} · node {service.node_id}</title>" in (await client.get(path)).text, path


async def test_read_only_mode_renders_no_edit_controls_and_off_serves_nothing(service: InProcessService) -> None:
    async with client_for(create_app(service)) as on, client_for(create_app(service, ui="read-only")) as read_only:
        assert 'id="edit-controls"' in (await on.get("/ui/keys/a")).text
        assert 'id="create-form"' in (await on.get("/ui/keys")).text
        key_page = (await read_only.get("/ui/keys/a")).text
        assert 'id="edit-controls"' not in key_page and 'id="editor"' not in key_page and "read-only" in key_page
        assert 'id="create-form"' not in (await read_only.get("/ui/keys")).text
        assert (await read_only.get("/ui/api/access", params={"key": "a"})).json() == {
            "mode": "read-only", "read": True, "write": False}
    async with client_for(create_app(service, ui="off")) as off:
        for path in [*PAGES, "/ui/static/common.js", "/ui/api/cluster"]:
            response = await off.get(path)
            assert response.status_code == 404 and response.headers["content-type"] == "application/problem+json"
        assert "/ui" not in str((await off.get("/openapi.json")).json()["paths"])


async def test_pages_are_open_and_the_dashboards_data_needs_a_valid_token(service: InProcessService,
                                                                       tmp_path: Path) -> None:
    token_file = tmp_path / "tokens.toml"
    token_file.write_text(f'[[tokens]]\nname = "reader"\nsha256 = "{hash_token("r-secret")}"\n'
                          'rules = { "" = "read", "app/" = "write" }\n')
    service.auth_tokens = AuthTokens(load_auth_policy(token_file))
    async with client_for(create_app(service)) as http:
        for path in [*PAGES, "/ui/static/key.js"]:
            assert (await http.get(path)).status_code == 200, path
        for path in ("/ui/api/cluster", "/ui/api/metrics", "/ui/api/access"):
            assert (await http.get(path)).status_code == 401, path
        reader = {"Authorization": "Bearer r-secret"}
        assert (await http.get("/ui/api/access", params={"key": "app/x"}, headers=reader)).json()["write"] is True
        assert (await http.get("/ui/api/access", params={"key": "cfg/x"}, headers=reader)).json() == {
            "mode": "on", "read": True, "write": False}
        cluster = await http.get("/ui/api/cluster", headers=reader)
        assert cluster.status_code == 200 and cluster.json()["leader_id"] == service.node_id
        assert (await http.get("/ui/api/metrics", headers=reader)).json()["node_id"] == service.node_id


async def test_a_mistyped_dashboard_url_is_redirected_or_a_problem_not_a_request_for_a_token(
        service: InProcessService, tmp_path: Path) -> None:
    """With auth on, /ui/ or /ui/nope answered 401 "send a token": the pages are open, so a
    person gets the page they meant, or a clean 404/405; /ui/api/ still needs the token."""
    token_file = tmp_path / "tokens.toml"
    token_file.write_text(f'[[tokens]]\nname = "r"\nsha256 = "{hash_token("s")}"\nrules = {{ "" = "read" }}\n')
    service.auth_tokens = AuthTokens(load_auth_policy(token_file))
    async with client_for(create_app(service)) as http:
        for typed, meant in (("/ui/", "/ui"), ("/ui/keys/", "/ui/keys"), ("/ui/watch/?prefix=a%2F", "/ui/watch?prefix=a%2F"),
                             ("/ui/keys/?prefix=a%2F&view=flat", "/ui/keys?prefix=a%2F&view=flat")):
            response = await http.get(typed)
            assert (response.status_code, response.headers["location"]) == (308, meant), typed
            assert (await http.get(meant)).status_code == 200
        for path in ("/ui/nope", "/ui/static", "/ui/watch/x"):
            response = await http.get(path)
            assert response.status_code == 404 and response.json()["type"] == "urn:metakv:problem:not-found", path
        refused = await http.post("/ui/keys/a", content=b"x")
        assert refused.status_code == 405 and refused.headers["allow"] == "GET, HEAD"
        assert refused.headers["content-type"] == "application/problem+json"
        assert (await http.get("/ui/api/nope")).status_code == 401
        assert (await http.get("/ui/keys/a%2Fb/")).status_code == 200  # a key ending in "/" is a key


async def test_the_dashboards_routes_are_not_part_of_the_api_description(client: httpx.AsyncClient) -> None:
    paths = (await client.get("/openapi.json")).json()["paths"]
    assert not [path for path in paths if path.startswith("/ui")]


async def test_a_peer_answering_something_else_is_shown_down_not_a_500(client: httpx.AsyncClient,
                                                                     service: InProcessService,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Another program on a peer's old port (or another version) answering 200 with other JSON
    made the snapshot raise, and every open tab got a 500 each second."""
    replicas = [{"node_id": node_id, "endpoint": f"http://peer{node_id}", "log_end_offset": 0, "lag": 0,
                 "last_fetch_timestamp_ms": None, "last_caught_up_timestamp_ms": None} for node_id in (2, 3, 4)]
    quorum: Any = service.quorum()
    monkeypatch.setattr(service, "quorum", lambda: {**quorum, "voters": [*quorum["voters"], *replicas[:2]],
                                                    "observers": replicas[2:]})
    answers = {"peer2": [1, 2], "peer3": {"node_id": 3}, "peer4": {**service.status(), "node_id": 4, "role": "follower",
                                                                  "voter": False}}
    real_client = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **options: real_client(
        transport=httpx.MockTransport(lambda request: httpx.Response(200, json=answers[request.url.host])), **options))
    response = await client.get("/ui/api/cluster")
    assert response.status_code == 200, response.text
    up = {node["node_id"]: node["up"] for node in response.json()["nodes"]}
    assert up == {service.node_id: True, 2: False, 3: False, 4: True}


def status(node_id: int, role: str, epoch: int, leader_id: int, voter: bool = True) -> dict[str, Any]:
    return {"node_id": node_id, "role": role, "epoch": epoch, "leader_id": leader_id, "voter": voter,
            "advertise_http": f"http://n{node_id}", "applied_version": 5}


def test_the_leader_is_the_one_of_the_highest_epoch_and_a_deposed_one_is_not_shown_as_leader() -> None:
    """Node 1 still believes it leads epoch 3 (partitioned); 2 and 3 elected node 2 in epoch 4."""
    statuses: dict[int, Any] = {1: status(1, "leader", 3, 1), 2: status(2, "leader", 4, 2),
                                3: status(3, "follower", 4, 2), 4: None}
    assert leader_of(statuses) == (2, 4)
    view = describe(3, statuses, None, 2, 4, now_ms=10_000)
    roles = {node["node_id"]: node["role"] for node in view["nodes"]}
    assert roles == {1: "deposed (epoch 3 < 4)", 2: "leader", 3: "follower", 4: "down"}
    assert [node["node_id"] for node in view["nodes"] if node["role"] == "leader"] == [2]
    # Without the leader's quorum view nobody can say, not even how many voters there are: a
    # node alone after losing its peers once showed "1 voters, majority 1" for a 3-voter cluster.
    assert (view["can_lose"], view["voters"], view["majority"], view["healthy_voters"]) == (None, None, None, None)
    alone = describe(2, {2: status(2, "follower", 4, -1)}, None, -1, -1, now_ms=10_000)
    assert (alone["voters"], alone["majority"], alone["can_lose"]) == (None, None, None)
    # No leader known: the newest epoch still, so a page that saw epoch 4's leader takes the
    # election in epoch 5 as newer and shows it (it kept showing the dead leader instead).
    assert leader_of({1: None, 2: status(2, "candidate", 5, -1), 3: status(3, "follower", 4, -1)}) == (-1, 5)
    assert leader_of({1: None}) == (-1, -1)


def test_fault_tolerance_counts_voters_that_answer_and_are_caught_up() -> None:
    def replica(node_id: int, caught_up_ms: int | None) -> dict[str, Any]:
        return {"node_id": node_id, "endpoint": f"http://n{node_id}", "log_end_offset": 9, "lag": 0,
                "last_fetch_timestamp_ms": caught_up_ms, "last_caught_up_timestamp_ms": caught_up_ms}

    quorum: Any = {"epoch": 2, "leader_id": 1, "high_watermark": 9,
                   "voters": [replica(1, None), replica(2, 9_000), replica(3, 9_500), replica(4, 1_000),
                              replica(5, 9_900)],
                   "observers": [replica(6, 9_000)]}
    statuses: dict[int, Any] = {1: status(1, "leader", 2, 1), 2: status(2, "follower", 2, 1),
                                3: status(3, "follower", 2, 1), 4: status(4, "follower", 2, 1), 5: None,
                                6: status(6, "follower", 2, 1, voter=False)}
    view = describe(1, statuses, quorum, 1, 2, now_ms=10_000)
    # 1 (leader), 2 and 3 healthy; 4 is far behind, 5 does not answer: 3 healthy of 5, majority 3.
    assert (view["voters"], view["majority"], view["healthy_voters"], view["can_lose"]) == (5, 3, 3, 0)
    assert {node["node_id"]: node["kind"] for node in view["nodes"]}[6] == "observer"


def test_a_bad_ui_mode_is_refused_in_one_line(tmp_path: Path, refused) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    line = refused(serve_args(tmp_path, ui="maybe"))
    assert line == "metakv: error: --ui: expected one of on, off, read-only, got 'maybe'"
    assert "METAKV_UI: expected one of" in refused(serve_args(tmp_path), env={"METAKV_UI": "yes"})
