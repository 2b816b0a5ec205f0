"""`metakv status` keeps its bearer token among the cluster members named with --url (audit
item 4): not to another host a redirect names, not to an endpoint /v1/quorum lists on another
host, never over http after https. Fake nodes (threads with http.server) record every
Authorization header they are sent; the CLI runs as a real process."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.cluster import REPO_ROOT
from tests.security.certs_fixture import CertSet

TOKEN = "status-token-under-test"
Route = Callable[[str], tuple[int, dict[str, str], bytes]]


class FakeNode:
    """An HTTP server on ``host`` answering with ``route(path)`` and keeping what it saw."""

    def __init__(self, host: str, route: Route, context: ssl.SSLContext | None = None) -> None:
        self.seen: list[tuple[str, str | None]] = []  # (path, Authorization)
        seen, answer = self.seen, route

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                seen.append((self.path, self.headers.get("Authorization")))
                status, headers, body = answer(self.path)
                self.send_response(status)
                for name, value in {**headers, "Content-Length": str(len(body))}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        if context is not None:
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        scheme = "https" if context is not None else "http"
        self.url = f"{scheme}://{host}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_nodes() -> Iterator[list[FakeNode]]:
    started: list[FakeNode] = []
    yield started
    for node in started:
        node.close()


def start(started: list[FakeNode], host: str, route: Route, context: ssl.SSLContext | None = None) -> FakeNode:
    node = FakeNode(host, route, context)
    started.append(node)
    return node


def status_body(node_id: int) -> bytes:
    return json.dumps({"node_id": node_id, "role": "follower", "applied_version": 1, "ready": True}).encode()


def quorum(voters: list[str], observers: list[str]) -> bytes:
    def replica(node_id: int, endpoint: str) -> dict[str, object]:
        return {"node_id": node_id, "endpoint": endpoint, "log_end_offset": 1, "lag": 0,
                "last_fetch_timestamp_ms": None}
    return json.dumps({"epoch": 1, "leader_id": 1, "high_watermark": 1,
                       "voters": [replica(i, url) for i, url in enumerate(voters, 1)],
                       "observers": [replica(10 + i, url) for i, url in enumerate(observers)]}).encode()


def run_status(url: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("METAKV_")}
    env.update(extra_env or {}, METAKV_TOKEN=TOKEN)
    return subprocess.run([sys.executable, "-m", "app.cli", "status", "--url", url], capture_output=True,
                          text=True, cwd=REPO_ROOT, env=env, timeout=60)


def tokens_sent(node: FakeNode) -> list[str]:
    return [path for path, authorization in node.seen if authorization == f"Bearer {TOKEN}"]


def test_a_redirect_to_another_host_does_not_carry_the_token(fake_nodes: list[FakeNode]) -> None:
    elsewhere = start(fake_nodes, "127.0.0.2", lambda path: (401, {}, b"{}"))
    member = start(fake_nodes, "127.0.0.1", lambda path: (307, {"Location": f"{elsewhere.url}{path}"}, b""))
    result = run_status(member.url)
    assert elsewhere.seen, "the redirect was followed"
    assert tokens_sent(elsewhere) == []
    assert tokens_sent(member) == ["/v1/quorum"]
    assert result.returncode == 1 and "127.0.0.2 is not a host of --url" in result.stderr, result.stderr


def test_an_endpoint_listed_by_the_quorum_on_another_host_is_asked_without_the_token(
        fake_nodes: list[FakeNode]) -> None:
    observer = start(fake_nodes, "127.0.0.2", lambda path: (401, {}, b"{}"))
    routes: dict[str, bytes] = {}
    member = start(fake_nodes, "127.0.0.1", lambda path: (200, {"Content-Type": "application/json"}, routes[path]))
    routes.update({"/v1/quorum": quorum([member.url], [observer.url]), "/v1/status": status_body(1)})
    result = run_status(member.url)
    assert result.returncode == 0, result.stderr
    assert [path for path, _ in observer.seen] == ["/v1/status"]
    assert tokens_sent(observer) == []
    assert sorted(tokens_sent(member)) == ["/v1/quorum", "/v1/status"]
    assert "not in --url" in result.stdout


def test_an_https_node_never_sends_the_client_to_http(fake_nodes: list[FakeNode], certs: CertSet) -> None:
    plain = start(fake_nodes, "127.0.0.1", lambda path: (200, {}, quorum([], [])))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    files = certs.node(1)
    context.load_cert_chain(files.cert_file, files.key_file)
    secure = start(fake_nodes, "127.0.0.1", lambda path: (307, {"Location": f"{plain.url}{path}"}, b""), context)
    result = run_status(secure.url, {"SSL_CERT_FILE": str(certs.ca)})
    assert tokens_sent(secure) == ["/v1/quorum"]
    assert plain.seen == []
    assert result.returncode == 1 and "refusing to leave https" in result.stderr, result.stderr


@pytest.mark.parametrize("body", [b"[]", b'{"epoch": 1, "leader_id": 1, "high_watermark": 1, "voters": [1]}'])
def test_an_answer_that_is_not_a_quorum_table_is_one_line_not_a_traceback(
        fake_nodes: list[FakeNode], body: bytes) -> None:
    """--url naming something else than a metakv node (or a node answering nonsense)."""
    other = start(fake_nodes, "127.0.0.1", lambda path: (200, {"Content-Type": "application/json"}, body))
    result = run_status(other.url)
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert "is not a quorum table" in result.stderr, result.stderr
