"""Bearer-token auth (app/auth.py, docs/http.md "Auth") on real `metakv serve` processes.

One 3-voter cluster started with a token file serves most tests (module scope: starting a
cluster is the expensive part); a single node without a token file shows that nothing
changes when auth is off; bad token files are checked through the command line (exit 2).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.auth import Access, hash_token, load_auth_policy
from app.cli import main
from app.http.audit import AuditLog
from app.http.auth import txn_keys
from tests.cluster import REPO_ROOT, Cluster, Node

SECRETS = {
    "root": "root-secret-0f3a",
    "reader": "reader-secret-77c1",
    "app-writer": "app-writer-secret-1b9e",
    "no-secrets": "no-secrets-secret-5d20",
    "mixed": "mixed-secret-a6e4",
    "ops": "ops-secret-c3d8",
}
RULES = {
    "root": {"": "admin"},
    "reader": {"": "read"},
    "app-writer": {"app/": "write"},
    "no-secrets": {"": "read", "secret/": "deny"},
    "mixed": {"": "read", "app/": "write"},
    "ops": {"": "admin", "secret/": "deny"},
}


def token_file_text() -> str:
    parts = []
    for name, secret in SECRETS.items():
        rules = ", ".join(f"{json.dumps(prefix)} = {json.dumps(access)}" for prefix, access in RULES[name].items())
        parts.append(f'[[tokens]]\nname = "{name}"\nsha256 = "{hash_token(secret)}"\nrules = {{ {rules} }}\n')
    return "\n".join(parts)


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {SECRETS[name]}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("auth")
    token_file = root / "tokens.toml"
    token_file.write_text(token_file_text())
    started = Cluster(root / "cluster", voters=3, settings={"auth_file": token_file}, token=SECRETS["root"])
    try:
        started.start()
        started.wait_for_leader()
        yield started
    finally:
        print(started.logs())
        started.close()


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    """A client with no token of its own that never follows redirects."""
    with httpx.Client(timeout=10.0) as client:
        yield client


def leader_and_follower(cluster: Cluster) -> tuple[Node, Node]:
    leader = cluster.wait_for_leader()
    follower = next(node for node in cluster.voters if node.node_id != leader.node_id)
    return leader, follower


def put_as_root(cluster: Cluster, key: str, value: bytes) -> int:
    response = cluster.put(key, value)
    assert response.status_code == 200, response.text
    return int(response.json()["version"])


def assert_problem(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = response.json()
    assert body["status"] == status and body["type"].startswith("urn:metakv:problem:") and body["detail"]
    return body


# ---------------------------------------------------------------------------- 401


def test_no_token_is_401_with_a_bearer_challenge_and_node_headers(cluster: Cluster, http: httpx.Client) -> None:
    leader = cluster.wait_for_leader()
    for method, path in [("GET", "/v1/kv/app/x"), ("PUT", "/v1/kv/app/x"), ("GET", "/v1/kv?prefix=app/"),
                         ("POST", "/v1/txn"), ("POST", "/v1/admin/snapshot"), ("GET", "/v1/status"),
                         ("GET", "/v1/quorum"), ("GET", "/v1/no-such-route")]:
        response = http.request(method, f"{leader.url}{path}")
        assert_problem(response, 401)
        assert response.headers["www-authenticate"].startswith("Bearer")
        assert response.headers["x-node-id"] == str(leader.node_id)


def test_wrong_or_malformed_token_is_401(cluster: Cluster, http: httpx.Client) -> None:
    leader = cluster.wait_for_leader()
    for header in ["Bearer not-a-token", f"Basic {SECRETS['root']}", "Bearer", SECRETS["root"],
                   f"Bearer {SECRETS['root']}x"]:
        response = http.get(f"{leader.url}/v1/kv/app/x", headers={"Authorization": header})
        assert_problem(response, 401)
        assert "Bearer" in response.headers["www-authenticate"]
    # The scheme is case-insensitive (RFC 9110), the token is not.
    response = http.get(f"{leader.url}/v1/status", headers={"Authorization": f"bearer {SECRETS['reader']}"})
    assert response.status_code == 200


# ---------------------------------------------------------------------------- keys


def test_read_only_token_can_get_but_put_and_delete_are_403(cluster: Cluster, http: httpx.Client) -> None:
    leader = cluster.wait_for_leader()
    put_as_root(cluster, "app/ro", b"original")
    url = f"{leader.url}/v1/kv/app/ro"
    response = http.get(url, headers=bearer("reader"))
    assert response.status_code == 200 and response.content == b"original"
    assert http.head(url, headers=bearer("reader")).status_code == 200
    assert_problem(http.put(url, content=b"changed", headers=bearer("reader")), 403)
    assert_problem(http.delete(url, headers=bearer("reader")), 403)
    assert http.get(url, headers=bearer("reader")).content == b"original"


def test_prefix_rules_are_respected(cluster: Cluster, http: httpx.Client) -> None:
    leader = cluster.wait_for_leader()
    put_as_root(cluster, "other/k", b"theirs")
    response = http.put(f"{leader.url}/v1/kv/app/mine", content=b"1", headers=bearer("app-writer"))
    assert response.status_code == 200, response.text
    assert http.get(f"{leader.url}/v1/kv/app/mine", headers=bearer("app-writer")).content == b"1"
    body = assert_problem(http.put(f"{leader.url}/v1/kv/other/k", content=b"x", headers=bearer("app-writer")), 403)
    assert "other/k" in body["detail"]
    assert_problem(http.get(f"{leader.url}/v1/kv/other/k", headers=bearer("app-writer")), 403)  # no rule: denied
    # A key that only looks like it is under app/ once decoded by hand is still judged as the route reads it.
    assert_problem(http.put(f"{leader.url}/v1/kv/other%2Fk", content=b"x", headers=bearer("app-writer")), 403)
    assert http.get(f"{leader.url}/v1/kv/other/k", headers=bearer("root")).content == b"theirs"
    # List and watch need read on every key under the prefix.
    listed = http.get(f"{leader.url}/v1/kv", params={"prefix": "app/"}, headers=bearer("app-writer"))
    assert listed.status_code == 200 and "app/mine" in [item["key"] for item in listed.json()["items"]]
    assert_problem(http.get(f"{leader.url}/v1/kv", params={"prefix": ""}, headers=bearer("app-writer")), 403)
    assert_problem(http.get(f"{leader.url}/v1/kv", params={"prefix": "ot"}, headers=bearer("app-writer")), 403)
    watch = http.get(f"{leader.url}/v1/watch", params={"prefix": "app/", "since": 0, "timeout_ms": 0},
                     headers=bearer("app-writer"))
    assert watch.status_code == 200 and watch.json()["events"]
    assert_problem(http.get(f"{leader.url}/v1/watch", params={"prefix": "", "timeout_ms": 0},
                            headers=bearer("app-writer")), 403)


def test_a_deny_rule_cannot_be_bypassed_by_listing_its_parent(cluster: Cluster, http: httpx.Client) -> None:
    leader = cluster.wait_for_leader()
    put_as_root(cluster, "secret/password", b"hunter2")
    put_as_root(cluster, "public/motd", b"hello")
    headers = bearer("no-secrets")
    assert http.get(f"{leader.url}/v1/kv/public/motd", headers=headers).content == b"hello"
    assert_problem(http.get(f"{leader.url}/v1/kv/secret/password", headers=headers), 403)
    assert http.get(f"{leader.url}/v1/kv", params={"prefix": "public/"}, headers=headers).status_code == 200
    for prefix in ("", "s", "secret/"):
        assert_problem(http.get(f"{leader.url}/v1/kv", params={"prefix": prefix}, headers=headers), 403)
        assert_problem(http.get(f"{leader.url}/v1/watch", params={"prefix": prefix, "timeout_ms": 0},
                                headers=headers), 403)
    # The last prefix= wins, as in the route: a harmless first one does not help.
    response = http.get(f"{leader.url}/v1/kv?prefix=public/&prefix=secret/", headers=headers)
    assert_problem(response, 403)


# ---------------------------------------------------------------------------- txn


def test_txn_touching_a_forbidden_key_is_403_and_changes_nothing(cluster: Cluster, http: httpx.Client) -> None:
    leader = cluster.wait_for_leader()
    version = put_as_root(cluster, "other/txn", b"before")
    txn = {"compare": [], "success": [{"op": "put", "key": "app/txn-a", "value": "1"},
                                      {"op": "put", "key": "other/txn", "value": "after"}]}
    body = assert_problem(http.post(f"{leader.url}/v1/txn", json=txn, headers=bearer("app-writer")), 403)
    assert "other/txn" in body["detail"]
    # Also when the forbidden key is only in the failure branch, or only read by a get op.
    for branch in ({"failure": [{"op": "delete", "key": "other/txn"}]},
                   {"success": [{"op": "get", "key": "other/txn"}]},
                   {"compare": [{"key": "other/txn", "exists": True}]}):
        response = http.post(f"{leader.url}/v1/txn", json={"success": [{"op": "put", "key": "app/txn-a", "value": "1"}],
                                                           **branch}, headers=bearer("app-writer"))
        assert_problem(response, 403)
    root = cluster.client()
    assert root.get(f"{leader.url}/v1/kv/app/txn-a", params={"min_version": version}).status_code == 404
    assert root.get(f"{leader.url}/v1/kv/other/txn").content == b"before"
    # Allowed: write on app/, read (compare) on other/.
    allowed = {"compare": [{"key": "other/txn", "value": "before"}],
               "success": [{"op": "put", "key": "app/txn-b", "value": "2"}, {"op": "get", "key": "other/txn"}]}
    response = http.post(f"{leader.url}/v1/txn", json=allowed, headers=bearer("mixed"))
    assert response.status_code == 200, response.text
    assert response.json()["succeeded"] is True
    assert root.get(f"{leader.url}/v1/kv/app/txn-b").content == b"2"
    # A body the route would refuse is still 422 for a restricted token, never let through.
    malformed = http.post(f"{leader.url}/v1/txn", content=b"{not json", headers=bearer("mixed"))
    assert_problem(malformed, 422)


# ---------------------------------------------------------------------------- routes


def test_admin_routes_need_admin(cluster: Cluster, http: httpx.Client) -> None:
    leader = cluster.wait_for_leader()
    for name in ("reader", "app-writer", "mixed"):
        assert_problem(http.post(f"{leader.url}/v1/admin/snapshot", headers=bearer(name)), 403)
    response = http.post(f"{leader.url}/v1/admin/snapshot", headers=bearer("root"))
    assert response.status_code == 200, response.text
    assert "snapshot_id" in response.json()
    # Admin comes from the rule on "": narrower rules limit the keys, not the admin routes.
    assert http.post(f"{leader.url}/v1/admin/snapshot", headers=bearer("ops")).status_code == 200
    put_as_root(cluster, "secret/ops", b"x")
    assert_problem(http.get(f"{leader.url}/v1/kv/secret/ops", headers=bearer("ops")), 403)
    assert http.put(f"{leader.url}/v1/kv/app/ops", content=b"x", headers=bearer("ops")).status_code == 200


def test_health_metrics_and_openapi_are_open_and_cluster_views_need_any_token(
        cluster: Cluster, http: httpx.Client) -> None:
    leader, follower = leader_and_follower(cluster)
    for path in ("/healthz", "/readyz", "/metrics", "/openapi.json", "/docs"):
        assert http.get(f"{follower.url}{path}").status_code == 200, path
    assert http.get(f"{leader.url}/v1/status", headers=bearer("app-writer")).status_code == 200
    assert http.get(f"{leader.url}/v1/quorum", headers=bearer("app-writer")).status_code == 200


def test_follower_redirects_only_after_auth(cluster: Cluster, http: httpx.Client) -> None:
    leader, follower = leader_and_follower(cluster)
    url = f"{follower.url}/v1/kv/app/redirected"
    assert_problem(http.put(url, content=b"v"), 401)
    assert_problem(http.put(url, content=b"v", headers=bearer("reader")), 403)
    response = http.put(url, content=b"v", headers=bearer("app-writer"))
    assert response.status_code == 307
    location = response.headers["location"]
    assert location.startswith(leader.url)
    # The client must send the token again to the leader (curl: --location-trusted).
    assert_problem(http.put(location, content=b"v"), 401)
    assert http.put(location, content=b"v", headers=bearer("app-writer")).status_code == 200


def test_openapi_documents_the_bearer_scheme_and_401_403(cluster: Cluster, http: httpx.Client) -> None:
    document = http.get(f"{cluster.wait_for_leader().url}/openapi.json").json()
    assert document["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http", "scheme": "bearer", "description": document["components"]["securitySchemes"]["bearerAuth"]["description"]}
    assert document["security"] == [{"bearerAuth": []}]
    paths = document["paths"]
    for path, method in [("/v1/kv/{key}", "put"), ("/v1/kv/{key}", "get"), ("/v1/kv", "get"),
                         ("/v1/txn", "post"), ("/v1/watch", "get"), ("/v1/admin/snapshot", "post")]:
        responses = paths[path][method]["responses"]
        assert {"401", "403"} <= set(responses), (path, method)
        assert "WWW-Authenticate" in responses["401"]["headers"]
    assert "401" in paths["/v1/status"]["get"]["responses"]
    assert "403" not in paths["/v1/status"]["get"]["responses"]
    for path in ("/healthz", "/readyz", "/metrics"):
        assert paths[path]["get"]["security"] == []
        assert "401" not in paths[path]["get"]["responses"]


def test_metakv_status_with_token_works_against_an_auth_cluster(cluster: Cluster) -> None:
    _leader, follower = leader_and_follower(cluster)
    env = {key: value for key, value in os.environ.items() if not key.startswith("METAKV_")}
    command = [sys.executable, "-m", "app.cli", "status", "--url", follower.url]
    refused = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=60)
    assert refused.returncode == 1 and "--token" in refused.stderr
    # Through a follower: /v1/quorum redirects to the leader and the token goes along.
    shown = subprocess.run([*command, "--token", SECRETS["reader"]], capture_output=True, text=True,
                           cwd=REPO_ROOT, env=env, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "LOG END" in shown.stdout and len(shown.stdout.splitlines()) == 2 + 3
    from_env = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT,
                              env={**env, "METAKV_TOKEN": SECRETS["root"]}, timeout=60)
    assert from_env.returncode == 0, from_env.stderr


# ---------------------------------------------------------------------------- auth off


def test_without_a_token_file_nothing_changes(cluster_factory: Callable[..., Cluster]) -> None:
    plain = cluster_factory(voters=1)
    node = plain.wait_for_leader()
    with httpx.Client(timeout=10.0) as http:
        assert http.put(f"{node.url}/v1/kv/app/open", content=b"1").status_code == 200
        assert http.get(f"{node.url}/v1/kv/app/open").content == b"1"
        assert http.post(f"{node.url}/v1/admin/snapshot").status_code == 200
        # A token is simply ignored.
        assert http.get(f"{node.url}/v1/kv/app/open", headers={"Authorization": "Bearer junk"}).status_code == 200
        document = http.get(f"{node.url}/openapi.json").json()
    assert "securitySchemes" not in document["components"] and "security" not in document
    assert all("401" not in operation["responses"] for item in document["paths"].values()
               for operation in item.values())


# ---------------------------------------------------------------------------- bad token files


SERVE = ["serve", "--node-id", "1", "--data-dir", "DATA", "--listen-http", "127.0.0.1:1",
         "--listen-raft", "127.0.0.1:2", "--voters", "1@127.0.0.1:2"]
GOOD_HASH = hash_token("t")


@pytest.mark.parametrize(("text", "mentions"), [
    (None, "does not exist"),
    ("[[tokens]\nname = 'x'", "not valid TOML"),
    ("", "no [[tokens]]"),
    ("[[tokens]]\nname = 'a'\nsha256 = 'abc'\nrules = { '' = 'read' }", "sha256"),
    (f"[[tokens]]\nname = 'a'\nsha256 = '{GOOD_HASH}'\nrules = {{ 'app/' = 'admin' }}", "admin"),
    (f"[[tokens]]\nname = 'a'\nsha256 = '{GOOD_HASH}'\nrules = {{ 'app/' = 'readwrite' }}", "readwrite"),
    (f"[[tokens]]\nname = 'a'\nsha256 = '{GOOD_HASH}'", "rules"),
    (f"[[tokens]]\nname = 'a'\ntoken = 't'\nsha256 = '{GOOD_HASH}'\nrules = {{ '' = 'read' }}", "token"),
    (f"[[tokens]]\nname = 'a'\nsha256 = '{GOOD_HASH}'\nrules = {{ '' = 'read' }}\n"
     f"[[tokens]]\nname = 'a'\nsha256 = '{hash_token('u')}'\nrules = {{ '' = 'read' }}", "same name"),
    (f"[[tokens]]\nname = 'a'\nsha256 = '{GOOD_HASH}'\nrules = {{ '' = 'read' }}\n"
     f"[[tokens]]\nname = 'b'\nsha256 = '{GOOD_HASH.upper()}'\nrules = {{ '' = 'read' }}", "same sha256"),
])
def test_a_bad_token_file_exits_2_with_one_line_naming_it(
        text: str | None, mentions: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [key for key in os.environ if key.startswith("METAKV_")]:
        monkeypatch.delenv(key)
    path = tmp_path / "tokens.toml"
    if text is not None:
        path.write_text(text)
    assert main([*SERVE, "--auth-file", str(path)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and str(path) in error and mentions in error, error


def test_the_token_file_is_read_from_the_environment_and_the_config_file(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("METAKV_")}
    missing = tmp_path / "missing.toml"
    by_env = subprocess.run([sys.executable, "-m", "app.cli", *SERVE], capture_output=True, text=True,
                            cwd=REPO_ROOT, env={**env, "METAKV_AUTH_FILE": str(missing)}, timeout=60)
    assert by_env.returncode == 2 and str(missing) in by_env.stderr
    config = tmp_path / "node.toml"
    config.write_text(f"auth_file = {json.dumps(str(missing))}\n")
    by_config = subprocess.run([sys.executable, "-m", "app.cli", *SERVE, "--config", str(config)],
                               capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=60)
    assert by_config.returncode == 2 and str(missing) in by_config.stderr


# ---------------------------------------------------------------------------- rules, in process


def test_the_longest_prefix_wins_and_prefix_reads_need_every_key(tmp_path: Path) -> None:
    token = load_token(tmp_path, {"": "read", "apps/": "write", "apps/secret/": "deny"})
    assert token.access_to_key("config/x") == Access.READ
    assert token.access_to_key("apps/web") == Access.WRITE
    assert token.access_to_key("apps/secret/key") == Access.DENY
    assert token.access_to_prefix("apps/web/") == Access.WRITE
    assert token.access_to_prefix("apps/") == Access.DENY  # apps/secret/ is inside
    assert token.access_to_prefix("config/") == Access.READ
    assert load_token(tmp_path, {"apps/": "write"}).access_to_key("other") == Access.DENY  # no rule: denied


def test_txn_keys_names_every_key_of_both_branches() -> None:
    body = json.dumps({"compare": [{"key": "c", "exists": True}],
                       "success": [{"op": "put", "key": "p", "value": "1"}, {"op": "get", "key": "g"}],
                       "failure": [{"op": "delete", "key": "d"}]}).encode()
    assert txn_keys(body) == [("c", Access.READ), ("p", Access.WRITE), ("g", Access.READ), ("d", Access.WRITE)]
    # Duplicate members: the last one counts, as in the route's parser.
    assert txn_keys(b'{"success": [{"op": "put", "key": "a"}], "success": [{"op": "put", "key": "b"}]}') == [
        ("b", Access.WRITE)]


def load_token(tmp_path: Path, rules: dict[str, str]) -> Any:
    """The one token of a token file with these rules and the secret "t"."""
    path = tmp_path / "rules.toml"
    text = ", ".join(f"{json.dumps(prefix)} = {json.dumps(access)}" for prefix, access in rules.items())
    path.write_text(f'[[tokens]]\nname = "t"\nsha256 = "{GOOD_HASH}"\nrules = {{ {text} }}\n')
    policy = load_auth_policy(path)
    assert policy.authenticate(b"t") is policy.tokens[0] and policy.authenticate(b"u") is None
    return policy.tokens[0]


# ---------------------------------------------------------------------------- operations


def token_file_for(names: list[str]) -> str:
    return "\n".join(
        f'[[tokens]]\nname = "{name}"\nsha256 = "{hash_token(SECRETS[name])}"\n'
        f"rules = {{ {', '.join(f'{json.dumps(p)} = {json.dumps(a)}' for p, a in RULES[name].items())} }}\n"
        for name in names)


def test_sighup_reloads_the_token_file_and_a_bad_file_keeps_the_old_tokens(tmp_path: Path) -> None:
    token_file = tmp_path / "tokens.toml"
    token_file.write_text(token_file_for(["root", "reader"]))
    node_cluster = Cluster(tmp_path / "cluster", voters=1, settings={"auth_file": token_file}, token=SECRETS["root"])
    try:
        node_cluster.start()
        node = node_cluster.wait_for_leader()
        with httpx.Client(timeout=10.0) as http:
            url = f"{node.url}/v1/kv/app/x"

            def status_as(name: str) -> int:
                return http.get(url, headers=bearer(name)).status_code

            assert status_as("reader") == 404 and status_as("app-writer") == 401
            # Add app-writer, revoke reader: in force after SIGHUP, without a restart.
            token_file.write_text(token_file_for(["root", "app-writer"]))
            node.signal(signal.SIGHUP)
            node_cluster.wait_until(lambda: status_as("app-writer") == 404, timeout_s=10)
            assert status_as("reader") == 401
            assert http.put(url, content=b"v", headers=bearer("app-writer")).status_code == 200
            assert "auth: reloaded" in node.log_tail() and "added ['app-writer'], removed ['reader']" in node.log_tail()
            # A file that no longer validates: refused, logged, the tokens in force stay.
            token_file.write_text("[[tokens]]\nname = 'broken'\n")
            node.signal(signal.SIGHUP)
            node_cluster.wait_until(lambda: "token file not reloaded" in node.log_tail(), timeout_s=10)
            assert status_as("app-writer") == 200 and status_as("root") == 200 and status_as("reader") == 401
            assert node.running()
    finally:
        node_cluster.close()


def test_denied_requests_are_logged_with_method_path_client_and_reason(cluster: Cluster, http: httpx.Client) -> None:
    leader = cluster.wait_for_leader()
    http.put(f"{leader.url}/v1/kv/secret/denied-log", content=b"v", headers=bearer("reader"))
    http.get(f"{leader.url}/v1/kv/app/denied-log", headers={"Authorization": "Bearer not-a-token"})
    log_text = leader.log_tail()
    assert "audit: 403 PUT /v1/kv/secret/denied-log from 127.0.0.1:" in log_text
    assert "token 'reader': denied: token 'reader' lacks write access to the key 'secret/denied-log'" in log_text
    assert "audit: 401 GET /v1/kv/app/denied-log from 127.0.0.1:" in log_text
    assert "token -: denied: the token is not valid" in log_text
    assert SECRETS["reader"] not in log_text and "not-a-token" not in log_text  # never the secret


def test_the_audit_log_holds_back_past_its_rate_and_counts_what_it_held(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    audit = AuditLog(per_s=3, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="metakv.audit"):
        for _ in range(8):
            audit.denied({"method": "GET", "path": "/v1/kv/x", "client": ("127.0.0.1", 5000)}, 401,
                         "the token is not valid", None)
        assert len(caplog.records) == 3
        now[0] += 1.0
        audit.admin({"method": "POST", "path": "/v1/admin/snapshot", "client": ("127.0.0.1", 5001)}, 200, "ops")
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 4
    assert lines[0] == "audit: 401 GET /v1/kv/x from 127.0.0.1:5000 token -: denied: the token is not valid"
    assert lines[3] == ("audit: 200 POST /v1/admin/snapshot from 127.0.0.1:5001 token 'ops': admin action done "
                        "(5 more audit lines not logged)")


def test_a_flood_of_refusals_does_not_hide_an_admin_action(caplog: pytest.LogCaptureFixture) -> None:
    """A client hammering with a bad token used the whole budget, so an admin action in the
    same second had no audit line."""
    audit = AuditLog(per_s=3, clock=lambda: 100.0)
    with caplog.at_level(logging.WARNING, logger="metakv.audit"):
        for _ in range(50):
            audit.denied({"method": "GET", "path": "/v1/kv/x", "client": ("127.0.0.9", 5000)}, 401,
                         "the token is not valid", None)
        audit.admin({"method": "POST", "path": "/v1/admin/compact", "client": ("127.0.0.1", 5001)}, 200, "ops")
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 4
    assert lines[3] == ("audit: 200 POST /v1/admin/compact from 127.0.0.1:5001 token 'ops': admin action done "
                        "(47 more audit lines not logged)")


def test_every_admin_action_and_refusal_has_one_audit_line(cluster: Cluster, http: httpx.Client) -> None:
    leader, follower = leader_and_follower(cluster)
    put_as_root(cluster, "audit/k", b"v")
    marker = f"/v1/kv/audit/mark-{os.getpid()}-{id(http)}"  # other tests of the module audit too
    for node in (leader, follower):
        assert http.get(node.url + marker).status_code == 401
    assert http.post(f"{leader.url}/v1/admin/snapshot", headers=bearer("ops")).status_code == 200
    download = http.post(f"{leader.url}/v1/admin/snapshot/download", headers=bearer("root"))
    assert download.status_code == 200
    assert http.post(f"{follower.url}/v1/admin/resign", headers=bearer("ops")).status_code == 307
    assert http.post(f"{leader.url}/v1/admin/compact", headers=bearer("reader")).status_code == 403
    assert http.post(f"{leader.url}/v1/admin/compact").status_code == 401
    def audit_lines_since_marker(node: Node) -> list[str]:
        lines = [line for line in node.log_tail().splitlines() if "audit: " in line]
        start = next(index for index, line in enumerate(lines) if f" {marker} from " in line)
        return lines[start + 1:]

    leader_lines, follower_lines = audit_lines_since_marker(leader), audit_lines_since_marker(follower)

    def lines_for(lines: list[str], route: str) -> list[str]:
        return [re.sub(r"^.*?audit: (?=[0-9]{3} )", "", line) for line in lines if f" {route} from 127.0.0.1:" in line]

    [snapshot] = lines_for(leader_lines, "POST /v1/admin/snapshot")
    assert snapshot.startswith("200 ") and snapshot.endswith("token 'ops': admin action done")
    [downloaded] = lines_for(leader_lines, "POST /v1/admin/snapshot/download")
    assert downloaded.startswith("200 ") and downloaded.endswith("token 'root': admin action done")
    [resign] = lines_for(follower_lines, "POST /v1/admin/resign")
    assert resign.startswith("307 ") and resign.endswith("token 'ops': admin action redirected to the leader")
    refused, unauthenticated = lines_for(leader_lines, "POST /v1/admin/compact")
    assert refused.startswith("403 ") and "token 'reader': denied: token 'reader' lacks admin access" in refused
    assert unauthenticated.startswith("401 ") and "token -: denied: this node requires a token" in unauthenticated
