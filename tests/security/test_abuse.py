"""Limits that hold under abuse (issue 21): slowloris clients and huge headers, against a real
node. Each test asserts what a user sees (the node keeps answering, the abusive connection is
refused) and a memory bound, never a timing."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.cluster import Cluster

HEADER_TIMEOUT_MS = 2000
WRITE_STALL_TIMEOUT_MS = 1000
SLOW_READER_VALUES = 60
SLOW_READER_VALUE = b"s" * (256 * 1024)  # 15 MiB of events in all: more than every buffer on the way
HUGE_HEADER_BYTES = 200 * 1024 * 1024
CHUNK = b"a" * (1024 * 1024)
RSS_GROWTH_BOUND_KIB = 50 * 1024  # the unbounded parser grew by ~330 MiB (audit)
HALF_SENT_REQUESTS = 300
CLOSE_WAIT_S = 30.0
HALF_SENT = b"GET /v1/kv/k HTTP/1.1\r\nHost: metakv\r\nX-Slow: "


@pytest.fixture(scope="module")
def node_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("abuse"), voters=1,
                      settings={"header_timeout_ms": HEADER_TIMEOUT_MS,
                                "write_stall_timeout_ms": WRITE_STALL_TIMEOUT_MS})
    try:
        cluster.start()
        cluster.wait_for_leader()
        with httpx.Client(timeout=10.0) as client:
            assert client.put(f"{cluster.nodes[1].url}/v1/kv/k", content=b"v").status_code == 200
        yield cluster
    finally:
        print(cluster.logs())
        cluster.close()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS line")


def closed_metric(client: httpx.Client, url: str, reason: str) -> float:
    prefix = f'metakv_http_connections_closed_total{{reason="{reason}"}} '
    for line in client.get(f"{url}/metrics").text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix):])
    return 0.0


def read_until_closed(conn: socket.socket) -> bytes:
    """What the node sent before closing (it may reset instead, with unread data queued)."""
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := conn.recv(65536):
            received += chunk
    return received


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads VmRSS in /proc")
def test_a_200_mib_header_is_cut_off_early_and_memory_stays_bounded(node_cluster: Cluster) -> None:
    node = node_cluster.nodes[1]
    with httpx.Client(timeout=10.0) as client:
        # Just under the default limit (64 KiB): still served.
        response = client.get(f"{node.url}/v1/kv/k", headers={"X-Pad": "p" * 32 * 1024})
        assert response.status_code == 200 and response.content == b"v"
        assert node.pid is not None
        rss_before = rss_kib(node.pid)
        sent = 0
        with socket.create_connection(("127.0.0.1", node.http_port), timeout=10.0) as conn:
            conn.sendall(b"GET /v1/kv/k HTTP/1.1\r\nHost: metakv\r\nX-Big: ")
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                while sent < HUGE_HEADER_BYTES:
                    conn.sendall(CHUNK)
                    sent += len(CHUNK)
            answer = read_until_closed(conn)
        assert sent < HUGE_HEADER_BYTES, "the node read the whole 200 MiB header"
        assert answer == b"" or answer.startswith(b"HTTP/1.1 431 ")
        assert rss_kib(node.pid) - rss_before < RSS_GROWTH_BOUND_KIB
        assert closed_metric(client, node.url, "header_bytes") >= 1
        assert client.get(f"{node.url}/v1/kv/k").content == b"v"


def test_a_header_past_the_limit_that_arrives_in_one_read_is_answered_431(node_cluster: Cluster) -> None:
    """The whole request in one send: the parser completes the headers within the read that
    carries them, so a count of bytes received while headers are incomplete never sees them."""
    node = node_cluster.nodes[1]
    request = b"GET /v1/kv/k HTTP/1.1\r\nHost: metakv\r\nX-Pad: " + b"p" * (100 * 1024) + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", node.http_port), timeout=10.0) as conn:
        conn.sendall(request)
        answer = read_until_closed(conn)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b'"type":"urn:metakv:problem:header-too-large"' in answer
    with httpx.Client(timeout=10.0) as client:
        assert client.get(f"{node.url}/v1/kv/k").content == b"v"


def test_half_sent_requests_are_closed_after_the_header_timeout(node_cluster: Cluster) -> None:
    node = node_cluster.nodes[1]
    slow: list[socket.socket] = []
    try:
        with httpx.Client(timeout=10.0) as client:
            closed_before = closed_metric(client, node.url, "header_timeout")
            for _ in range(HALF_SENT_REQUESTS):
                conn = socket.create_connection(("127.0.0.1", node.http_port), timeout=CLOSE_WAIT_S)
                conn.sendall(HALF_SENT)
                slow.append(conn)
            # During the attack an ordinary GET is answered.
            response = client.get(f"{node.url}/v1/kv/k")
            assert response.status_code == 200 and response.content == b"v"
            answers = [read_until_closed(conn) for conn in slow]
            assert all(answer.startswith(b"HTTP/1.1 408 ") for answer in answers), \
                {answer[:40] for answer in answers}
            assert b'"type":"urn:metakv:problem:header-timeout"' in answers[0]
            assert closed_metric(client, node.url, "header_timeout") - closed_before >= HALF_SENT_REQUESTS
            assert client.get(f"{node.url}/v1/kv/k").content == b"v"
    finally:
        for conn in slow:
            conn.close()


def test_keep_alive_connection_serves_requests_past_the_header_timeout(node_cluster: Cluster) -> None:
    """The header clock runs only while a request's headers are incomplete: a connection busy
    with complete requests longer than the timeout is never cut."""
    node = node_cluster.nodes[1]
    with httpx.Client(timeout=10.0) as client:
        deadline_s = time.monotonic() + 2 * HEADER_TIMEOUT_MS / 1000
        served = 0
        while time.monotonic() < deadline_s:
            assert client.get(f"{node.url}/v1/kv/k").content == b"v"
            served += 1
            time.sleep(0.2)
        assert served >= 2


WATCHER_CAP = 5
LONG_POLL_MS = 3000


def watchers_gauge(client: httpx.Client, url: str) -> float:
    for line in client.get(f"{url}/metrics").text.splitlines():
        if line.startswith("metakv_http_watchers "):
            return float(line.split()[1])
    raise AssertionError("no metakv_http_watchers gauge")


def wait_for_gauge(client: httpx.Client, url: str, value: float) -> None:
    deadline_s = time.monotonic() + CLOSE_WAIT_S
    while watchers_gauge(client, url) != value:
        assert time.monotonic() < deadline_s, f"metakv_http_watchers never reached {value}"
        time.sleep(0.05)


def test_past_the_watcher_cap_a_watch_gets_429_and_reads_still_work(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path / "watchers", voters=1, settings={"max_watchers": WATCHER_CAP})
    polls: list[socket.socket] = []
    try:
        cluster.start()
        cluster.wait_for_leader()
        url = cluster.nodes[1].url
        with httpx.Client(timeout=10.0) as client:
            version = client.put(f"{url}/v1/kv/k", content=b"v").headers["x-metadata-version"]
            request = (f"GET /v1/watch?prefix=w/&since={version}&timeout_ms={LONG_POLL_MS} HTTP/1.1\r\n"
                       "Host: metakv\r\n\r\n").encode()
            for _ in range(WATCHER_CAP):
                conn = socket.create_connection(("127.0.0.1", cluster.nodes[1].http_port), timeout=CLOSE_WAIT_S)
                conn.sendall(request)
                polls.append(conn)
            wait_for_gauge(client, url, WATCHER_CAP)
            refused = client.get(f"{url}/v1/watch", params={"prefix": "w/", "since": version, "timeout_ms": 0})
            assert refused.status_code == 429, refused.text
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["type"] == "urn:metakv:problem:too-many-watchers"
            assert client.get(f"{url}/v1/kv/k").content == b"v"
            # The long-polls end (their timeout): the slots are free again.
            assert all(conn.recv(65536).startswith(b"HTTP/1.1 200 ") for conn in polls)
            wait_for_gauge(client, url, 0)
            again = client.get(f"{url}/v1/watch", params={"prefix": "w/", "since": version, "timeout_ms": 0})
            assert again.status_code == 200, again.text
    finally:
        for conn in polls:
            conn.close()
        print(cluster.logs())
        cluster.close()


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads VmRSS in /proc")
def test_an_sse_client_that_never_reads_is_disconnected_and_memory_stays_bounded(node_cluster: Cluster) -> None:
    node = node_cluster.nodes[1]
    with httpx.Client(timeout=10.0) as client:
        version = client.get(f"{node.url}/v1/kv/k").headers["x-metadata-version"]
        stalled_before = closed_metric(client, node.url, "write_stall")
        assert node.pid is not None
        rss_before = rss_kib(node.pid)
        with socket.socket() as reader:
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
            reader.settimeout(CLOSE_WAIT_S)
            reader.connect(("127.0.0.1", node.http_port))
            reader.sendall(f"GET /v1/watch?prefix=slow/&since={version}&timeout_ms=300000 HTTP/1.1\r\n"
                           "Host: metakv\r\nAccept: text/event-stream\r\n\r\n".encode())
            wait_for_gauge(client, node.url, 1)
            for index in range(SLOW_READER_VALUES):  # the reader reads none of it
                assert client.put(f"{node.url}/v1/kv/slow/{index}", content=SLOW_READER_VALUE).status_code == 200
            deadline_s = time.monotonic() + CLOSE_WAIT_S
            while closed_metric(client, node.url, "write_stall") == stalled_before:
                assert time.monotonic() < deadline_s, "the stalled SSE stream was never closed"
                time.sleep(0.05)
            wait_for_gauge(client, node.url, 0)  # the watch and its slot were released
            assert client.get(f"{node.url}/v1/kv/k").content == b"v"
        # The values themselves (SQLite's cache, the log) account for some growth; the
        # unread stream may not add the 15 MiB of events on top.
        assert rss_kib(node.pid) - rss_before < RSS_GROWTH_BOUND_KIB


PER_CLIENT_CAP = 50
NODE_CONNECTION_CAP = 120
IDLE_CONNECTIONS = 1000


def idle_connections(source: str, port: int, count: int) -> list[socket.socket]:
    """``count`` connections from the loopback address ``source`` that send nothing."""
    opened = []
    for _ in range(count):
        conn = socket.socket()
        opened.append(conn)
        conn.settimeout(CLOSE_WAIT_S)
        conn.bind((source, 0))
        conn.connect(("127.0.0.1", port))
    return opened


def wait_for_closed(client: httpx.Client, url: str, reason: str, count: float) -> None:
    deadline_s = time.monotonic() + CLOSE_WAIT_S
    while closed_metric(client, url, reason) < count:
        assert time.monotonic() < deadline_s, f"fewer than {count} connections closed for {reason}"
        time.sleep(0.05)


def test_idle_connections_meet_the_per_client_and_node_caps_and_others_are_served(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path / "connections", voters=1, settings={
        "max_connections_per_client": PER_CLIENT_CAP, "max_connections": NODE_CONNECTION_CAP,
        "header_timeout_ms": 600_000})  # the idle connections stay until the test closes them
    idle: list[socket.socket] = []
    try:
        cluster.start()
        cluster.wait_for_leader()
        node = cluster.nodes[1]
        with httpx.Client(timeout=10.0) as client:
            assert client.put(f"{node.url}/v1/kv/k", content=b"v").status_code == 200
            idle += idle_connections("127.0.0.2", node.http_port, IDLE_CONNECTIONS)
            wait_for_closed(client, node.url, "connections_per_client", IDLE_CONNECTIONS - PER_CLIENT_CAP)
            assert closed_metric(client, node.url, "connections_per_client") == IDLE_CONNECTIONS - PER_CLIENT_CAP
            # A refused connection reads a 503 problem document, then the close.
            refused = read_until_closed(idle[-1])
            assert refused.startswith(b"HTTP/1.1 503 ") and b"urn:metakv:problem:too-many-connections" in refused
            assert client.get(f"{node.url}/v1/kv/k").content == b"v"  # another client is served
            # Two more addresses fill the node: a new connection from anywhere is refused.
            idle += idle_connections("127.0.0.3", node.http_port, PER_CLIENT_CAP)
            idle += idle_connections("127.0.0.4", node.http_port, PER_CLIENT_CAP)
            wait_for_closed(client, node.url, "connections_per_node", 1)
            with httpx.Client(timeout=10.0) as newcomer:
                full = newcomer.get(f"{node.url}/v1/kv/k")
            assert full.status_code == 503 and full.json()["type"] == "urn:metakv:problem:too-many-connections"
            assert full.headers["retry-after"] == "1"
            for conn in idle:
                conn.close()
            idle.clear()
            deadline_s = time.monotonic() + CLOSE_WAIT_S
            with httpx.Client(timeout=10.0) as newcomer:
                while (answer := newcomer.get(f"{node.url}/v1/kv/k")).status_code == 503:
                    assert time.monotonic() < deadline_s, "the node stayed full after the clients left"
                    time.sleep(0.05)
                assert answer.content == b"v"
    finally:
        for conn in idle:
            conn.close()
        print(cluster.logs())
        cluster.close()


NESTING_DEPTH = 100_000
ANNOUNCED_BODY_BYTES = 1024 ** 3


def test_deeply_nested_txn_json_is_a_4xx_problem(node_cluster: Cluster) -> None:
    node = node_cluster.nodes[1]
    with httpx.Client(timeout=10.0) as client:
        nested = b'{"compare": ' + b"[" * NESTING_DEPTH + b"]" * NESTING_DEPTH + b"}"
        response = client.post(f"{node.url}/v1/txn", content=nested, headers={"Content-Type": "application/json"})
        assert response.status_code == 422, response.text
        assert response.json()["type"] == "urn:metakv:problem:invalid-body"
        assert client.get(f"{node.url}/v1/kv/k").content == b"v"


def test_a_list_page_or_a_txn_past_its_cap_is_a_4xx_problem(node_cluster: Cluster) -> None:
    node = node_cluster.nodes[1]
    with httpx.Client(timeout=10.0) as client:
        page = client.get(f"{node.url}/v1/kv", params={"limit": 10**9})
        assert page.status_code == 400 and page.json()["type"] == "urn:metakv:problem:invalid-parameter"
        ops = [{"op": "get", "key": f"k{index}"} for index in range(129)]  # the cap is 128 per branch
        assert client.post(f"{node.url}/v1/txn", json={"success": ops[:128]}).status_code == 200
        txn = client.post(f"{node.url}/v1/txn", json={"success": ops})
        assert txn.status_code == 422 and txn.json()["type"] == "urn:metakv:problem:invalid-body"


def test_a_1_gib_content_length_is_refused_without_reading_the_body(node_cluster: Cluster) -> None:
    node = node_cluster.nodes[1]
    for target in ("/v1/txn", "/v1/kv/big"):
        method = "POST" if target == "/v1/txn" else "PUT"
        with socket.create_connection(("127.0.0.1", node.http_port), timeout=CLOSE_WAIT_S) as conn:
            # Only the headers are sent: an answer proves the node did not wait for the body.
            conn.sendall(f"{method} {target} HTTP/1.1\r\nHost: metakv\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {ANNOUNCED_BODY_BYTES}\r\n\r\n".encode())
            answer = conn.recv(65536)
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
        assert b"application/problem+json" in answer


def test_a_long_poll_whose_client_left_frees_its_watcher_slot_at_once(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path / "gone", voters=1, settings={"max_watchers": 1})
    try:
        cluster.start()
        cluster.wait_for_leader()
        node = cluster.nodes[1]
        with httpx.Client(timeout=10.0) as client:
            version = client.put(f"{node.url}/v1/kv/k", content=b"v").headers["x-metadata-version"]
            request = (f"GET /v1/watch?prefix=w/&since={version}&timeout_ms=300000 HTTP/1.1\r\n"
                       "Host: metakv\r\n\r\n").encode()
            with socket.create_connection(("127.0.0.1", node.http_port), timeout=CLOSE_WAIT_S) as conn:
                conn.sendall(request)
                wait_for_gauge(client, node.url, 1)
            # The client went away (a reconnecting watcher): its slot is free long before
            # the 300 s its long-poll asked for, so the reconnect is served, not refused 429.
            wait_for_gauge(client, node.url, 0)
            again = client.get(f"{node.url}/v1/watch", params={"prefix": "w/", "since": version, "timeout_ms": 0})
            assert again.status_code == 200, again.text
            statuses = [line for line in client.get(f"{node.url}/metrics").text.splitlines()
                        if line.startswith("metakv_http_requests_total{") and 'route="/v1/watch"' in line]
            assert any('status="499"' in line for line in statuses), statuses
    finally:
        print(cluster.logs())
        cluster.close()


def test_the_answer_cap_and_the_longest_watch_are_serve_settings(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path / "settings", voters=1, settings={"max_answer_bytes": 2048,
                                                                 "max_watch_timeout_ms": 1500})
    try:
        cluster.start()
        cluster.wait_for_leader()
        node = cluster.nodes[1]
        with httpx.Client(timeout=CLOSE_WAIT_S) as client:
            for index in range(3):
                assert client.put(f"{node.url}/v1/kv/s/{index}", content=b"x" * 1024).status_code == 200
            page = client.get(f"{node.url}/v1/kv", params={"prefix": "s/"}).json()
            assert [item["key"] for item in page["items"]] == ["s/0", "s/1"] and page["next"] == "s/1"
            # An SSE stream asking for 300 s ends at the node's longest watch instead.
            with client.stream("GET", f"{node.url}/v1/watch", params={"prefix": "s/", "timeout_ms": 300_000},
                               headers={"Accept": "text/event-stream"}) as stream:
                text = "".join(stream.iter_text())
            assert text.count("event: put") == 3
    finally:
        print(cluster.logs())
        cluster.close()
