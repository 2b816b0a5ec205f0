"""An HTTPS node closes connections that never finish the TLS handshake within its header
timeout: before TLS is done the HTTP connection caps and header clock cannot see them, and
the event loop's default (60 s) let raw TCP connections hold descriptors for a minute."""

from __future__ import annotations

import contextlib
import socket
import time
from pathlib import Path

from loadtest.tls_clusters import TlsCluster
from tests.security.certs_fixture import CertSet

HEADER_TIMEOUT_MS = 1000
SILENT_CONNECTIONS = 20
CLOSED_WITHIN_S = 20.0  # generous: a third of the 60 s default, twenty header timeouts


def closed_before(conn: socket.socket, deadline: float) -> bool:
    """True when the node closed (EOF or reset) before ``deadline`` (time.monotonic())."""
    with contextlib.suppress(ConnectionResetError):
        while True:
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                if not conn.recv(65536):
                    return True
            except TimeoutError:
                return False
    return True


def test_connections_that_never_send_a_client_hello_are_closed(
        tmp_path: Path, certs: CertSet) -> None:
    cluster = TlsCluster(tmp_path, certs.directory, 1, settings={"header_timeout_ms": HEADER_TIMEOUT_MS})
    silent: list[socket.socket] = []
    try:
        cluster.start()
        node = cluster.wait_for_leader()
        silent = [socket.create_connection(("127.0.0.1", node.http_port), timeout=10.0)
                  for _ in range(SILENT_CONNECTIONS)]
        deadline = time.monotonic() + CLOSED_WITHIN_S
        still_open = [conn for conn in silent if not closed_before(conn, deadline)]
        assert still_open == [], f"{len(still_open)} of {SILENT_CONNECTIONS} connections still open"
        assert cluster.client().get(f"{node.url}/healthz").status_code == 200
    finally:
        for conn in silent:
            conn.close()
        cluster.close()
