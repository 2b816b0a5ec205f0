"""Hardening of a running node (issue 21): private data files, log lines, a storage quota."""

from __future__ import annotations

import stat
from collections.abc import Callable
from pathlib import Path

import httpx

from app.auth import hash_token
from app.http.log_text import loggable
from tests.cluster import Cluster

GROUP_OR_OTHER = stat.S_IRWXG | stat.S_IRWXO


def test_the_data_directory_and_every_file_in_it_are_the_owners_only(
        cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(voters=1)
    node = cluster.wait_for_leader()
    for index in range(20):
        assert cluster.put(f"private/{index}", b"secret").status_code == 200
    entries = [node.data_dir, *node.data_dir.rglob("*")]
    names = {path.name for path in entries}
    assert {"state.db", "state.db-wal", "quorum-state", "LOCK"} <= names, names
    assert any(path.suffix == ".log" for path in entries)
    assert stat.S_IMODE(node.data_dir.stat().st_mode) == 0o700
    exposed = {str(path.relative_to(node.data_dir)): oct(stat.S_IMODE(path.stat().st_mode))
               for path in entries if path.stat().st_mode & GROUP_OR_OTHER}
    assert exposed == {}


def test_a_newline_in_a_path_cannot_forge_a_log_line(tmp_path: Path) -> None:
    token_file = tmp_path / "tokens.toml"
    token_file.write_text(f'[[tokens]]\nname = "reader"\nsha256 = "{hash_token("reader-secret")}"\n'
                          'rules = { "" = "read" }\n')
    cluster = Cluster(tmp_path / "cluster", voters=1, settings={"auth_file": token_file}, token="reader-secret")
    try:
        cluster.start()
        node = cluster.wait_for_leader()
        forged = "/v1/kv/a%0Aforged%20line%0D%1B[31m"
        with httpx.Client(timeout=10.0) as http:
            assert http.get(node.url + forged).status_code == 401
            assert http.put(node.url + forged, content=b"v",
                            headers={"Authorization": "Bearer reader-secret"}).status_code == 403
        log_lines = node.log_tail().splitlines()
        assert sum("audit: " in line and "/v1/kv/a\\nforged line\\r\\x1b[31m" in line for line in log_lines) == 2
        assert not any(line.startswith("forged") for line in log_lines)
        assert "\x1b" not in node.log_tail()
    finally:
        cluster.close()


def test_loggable_escapes_control_characters_and_keeps_printable_text() -> None:
    assert loggable("/v1/kv/a\nb\r\x1b\u2028é") == "/v1/kv/a\\nb\\r\\x1b\\u2028é"
    assert loggable("/v1/kv/plain key") == "/v1/kv/plain key"


QUOTA_BYTES = 1024 * 1024
QUOTA_VALUE = b"q" * 8192
QUOTA_MAX_WRITES = 1000  # 8 MiB: far past the quota, a bound on the loop


def metric(http: httpx.Client, url: str, name: str) -> float:
    for line in http.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} metric")


def test_past_the_quota_writes_answer_507_and_reads_and_deletes_still_work(
        cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(voters=1, settings={"quota_bytes": QUOTA_BYTES})
    node = cluster.wait_for_leader()
    http = cluster.client()
    assert metric(http, node.url, "metakv_quota_exceeded") == 0
    assert metric(http, node.url, "metakv_quota_used_bytes") < QUOTA_BYTES
    refused = None
    for index in range(QUOTA_MAX_WRITES):
        response = cluster.put(f"quota/{index}", QUOTA_VALUE)
        if response.status_code != 200:
            refused = response
            break
    assert refused is not None, f"{QUOTA_MAX_WRITES} writes of {len(QUOTA_VALUE)} bytes all fit a {QUOTA_BYTES}-byte quota"
    assert index > 0
    assert refused.status_code == 507, refused.text
    assert refused.headers["content-type"].startswith("application/problem+json")
    problem = refused.json()
    assert problem["title"] == "Storage quota exceeded" and "quota-exceeded" in problem["type"]
    assert "--quota-bytes" in problem["detail"]
    assert metric(http, node.url, "metakv_quota_exceeded") == 1
    assert metric(http, node.url, "metakv_quota_used_bytes") > QUOTA_BYTES
    assert http.get(f"{node.url}/v1/kv/quota/0").content == QUOTA_VALUE  # reads work
    assert http.delete(f"{node.url}/v1/kv/quota/0").status_code == 200  # deletes work
    assert http.get(f"{node.url}/v1/kv/quota/0").status_code == 404
    deletes_and_gets = {"success": [{"op": "delete", "key": "quota/1"}, {"op": "get", "key": "quota/2"}]}
    assert http.post(f"{node.url}/v1/txn", json=deletes_and_gets).status_code == 200, "a txn that adds nothing"
    with_a_put = {"success": [{"op": "delete", "key": "quota/3"}, {"op": "put", "key": "quota/x", "value": "v"}]}
    assert http.post(f"{node.url}/v1/txn", json=with_a_put).status_code == 507
    assert http.get(f"{node.url}/v1/kv/quota/3").status_code == 200  # that txn changed nothing
