"""Real processes on loopback with TLS everywhere: three voters with peer mutual TLS, HTTPS
that requires a client certificate, and a token file whose token names the client
certificates may stand for. One cluster for the module (starting one costs seconds)."""

from __future__ import annotations

import hashlib
import shutil
import signal
import ssl
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.local_cluster import Node
from loadtest.tls_clusters import TlsCluster
from loadtest.tls_clusters import client_context as tls_client_context
from tests.security.certs_fixture import CertSet

VOTERS = 3
ROGUES = {4: "other-ca", 5: "expired", 6: "no peer TLS"}


def client_context(certs: CertSet, client: str | None) -> ssl.SSLContext:
    return tls_client_context(certs.directory, certs.client(client) if client is not None else None)


def peer_flags(certs: CertSet, node_id: int, kind: str = "") -> list[str]:
    files = certs.node(node_id, kind)
    return ["--peer-tls-cert-file", str(files.cert_file), "--peer-tls-key-file", str(files.key_file),
            "--peer-tls-ca-file", str(files.ca_file)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, certs: CertSet) -> Iterator[TlsCluster]:
    root = Path(tmp_path_factory.mktemp("tls-cluster"))
    tokens = root / "tokens.toml"
    tokens.write_text(f'[[tokens]]\nname = "root"\nsha256 = "{hashlib.sha256(b"root-secret").hexdigest()}"\n'
                      '[tokens.rules]\n"" = "admin"\n')
    cluster = TlsCluster(root, certs.directory, VOTERS, client_cert=certs.client("root"), settings={
        "auth_file": tokens, "tls_client_ca_file": certs.ca, "allowed_observers": ",".join(map(str, ROGUES))})
    try:
        cluster.start()
        cluster.wait_for_leader()
        yield cluster
    finally:
        cluster.close()


def test_a_cluster_with_peer_mtls_forms_and_an_https_client_following_a_307_stays_on_https(
        cluster: TlsCluster) -> None:
    leader = cluster.wait_for_leader()
    follower = next(node for node in cluster.voters if node.node_id != leader.node_id)
    client = cluster.client()
    response = client.put(f"{follower.url}/v1/kv/tls/a", content=b"1", follow_redirects=True)
    assert response.status_code == 200, response.text
    assert [r.status_code for r in response.history] == [307]
    assert response.history[0].headers["location"].startswith(f"https://127.0.0.1:{leader.http_port}/")
    assert response.url.scheme == "https"
    cluster.wait_ready(follower)
    replicated = client.get(f"{follower.url}/v1/kv/tls/a", params={"consistency": "local",
                                                                   "min_version": response.json()["version"],
                                                                   "wait_ms": 10000})
    assert replicated.content == b"1"


def test_a_client_without_a_client_certificate_is_refused(cluster: TlsCluster, certs: CertSet) -> None:
    node = cluster.wait_for_leader()
    with httpx.Client(verify=client_context(certs, None), timeout=10.0) as anonymous, \
            pytest.raises(httpx.TransportError):
        anonymous.get(f"{node.url}/healthz")
    with httpx.Client(verify=ssl.create_default_context(), timeout=10.0) as untrusting, \
            pytest.raises(httpx.ConnectError):  # the node's certificate is from the cluster's own CA
        untrusting.get(f"{node.url}/healthz")


def test_a_client_certificate_stands_for_the_token_of_its_name(cluster: TlsCluster, certs: CertSet) -> None:
    node = cluster.wait_for_leader()
    assert cluster.client().put(f"{node.url}/v1/kv/tls/by-cert", content=b"x").status_code == 200
    with httpx.Client(verify=client_context(certs, "stranger"), timeout=10.0) as stranger:
        refused = stranger.get(f"{node.url}/v1/kv/tls/by-cert")
        assert refused.status_code == 401
        assert "names no token" in refused.json()["detail"]
        with_token = stranger.get(f"{node.url}/v1/kv/tls/by-cert", headers={"Authorization": "Bearer root-secret"})
        assert with_token.status_code == 200 and with_token.content == b"x"


def test_nodes_without_a_certificate_of_the_cluster_ca_are_refused_and_the_cluster_serves(
        cluster: TlsCluster, certs: CertSet) -> None:
    rogues: list[Node] = []
    voter = cluster.voters[0]
    voters_flag = voter.command[voter.command.index("--voters") + 1]
    try:
        for node_id, kind in ROGUES.items():
            http_port, raft_port = _free_pair()
            command = [sys.executable, "-m", "app.cli", "serve", "--node-id", str(node_id), "--observer",
                       "--data-dir", str(cluster.root / f"rogue{node_id}"), "--voters", voters_flag,
                       "--listen-http", f"127.0.0.1:{http_port}", "--listen-raft", f"127.0.0.1:{raft_port}"]
            if kind != "no peer TLS":
                command += peer_flags(certs, node_id, kind)
            rogue = Node(node_id, http_port, raft_port, cluster.root / f"rogue{node_id}",
                         cluster.root / f"rogue{node_id}.log", observer=True, command=command, env=dict(voter.env))
            rogue.start()
            rogues.append(rogue)
        for rogue in rogues:
            cluster.wait_until(lambda r=rogue: "handshake with peer" in r.log_tail(), what=f"rogue {rogue.node_id} refused")
        time.sleep(1.0)
        assert cluster.put("tls/after-rogues", b"still serving").status_code == 200
        for rogue in rogues:
            status = httpx.get(f"{rogue.url}/v1/status", timeout=10.0).json()
            assert status["applied_version"] == 0 and status["leader_id"] in (-1, None), status
        refusals = "".join(node.log_tail() for node in cluster.voters)
        assert "refused raft connection" in refusals and "TLS" in refusals, refusals
    finally:
        for rogue in rogues:
            rogue.kill()
            shutil.rmtree(rogue.data_dir, ignore_errors=True)


def _free_pair() -> tuple[int, int]:
    from loadtest.local_cluster import free_ports
    first, second = free_ports(2)
    return first, second


def test_sighup_reloads_the_http_certificate(cluster: TlsCluster, certs: CertSet, tmp_path: Path) -> None:
    """The node's HTTPS certificate files are replaced and SIGHUP sent: new connections get the
    new certificate (a new serial), the node keeps serving."""
    node = cluster.nodes[VOTERS]
    cert_file = Path(node.command[node.command.index("--tls-cert-file") + 1])
    key_file = Path(node.command[node.command.index("--tls-key-file") + 1])
    before = _served_serial(node)
    backup = tmp_path / "backup"
    backup.mkdir()
    shutil.copy(cert_file, backup / "node.crt")
    shutil.copy(key_file, backup / "node.key")
    try:
        new_cert = _issue_from_cluster_ca(certs, node.node_id, tmp_path)
        shutil.copy(new_cert[0], cert_file)
        shutil.copy(new_cert[1], key_file)
        node.signal(signal.SIGHUP)
        cluster.wait_until(lambda: "tls: reloaded the HTTP certificate" in node.log_tail(), what="the reload line")
        after = _served_serial(node)
        assert after != before
        assert cluster.client().get(f"{node.url}/readyz").status_code == 200
    finally:
        shutil.copy(backup / "node.crt", cert_file)
        shutil.copy(backup / "node.key", key_file)


def _issue_from_cluster_ca(certs: CertSet, node_id: int, directory: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    from app.certs import Issued, issue, write_pair
    from app.tls import node_name

    ca_key = serialization.load_pem_private_key((certs.directory / "ca.key").read_bytes(), password=None)
    ca = Issued(x509.load_pem_x509_certificate(certs.ca.read_bytes()), ca_key)  # type: ignore[arg-type]
    return write_pair(directory, "reissued", issue(ca, node_name(node_id), ("127.0.0.1", "localhost")))


def _served_serial(node: Node) -> int:
    from cryptography import x509

    pem = ssl.get_server_certificate(("127.0.0.1", node.http_port))
    return x509.load_pem_x509_certificate(pem.encode()).serial_number
