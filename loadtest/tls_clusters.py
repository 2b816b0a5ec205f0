"""Local clusters with TLS on, for the TLS benchmark and the TLS tests: metakv with HTTPS and
peer mutual TLS, and etcd with client and peer TLS from the same certificates (``metakv certs``
writes certificates etcd accepts: a CA, and per node a certificate for its name, 127.0.0.1 and
localhost, usable as server and client).

    certs = make_cluster_certs(root / "certs", 3)
    cluster = metakv_tls_cluster(root / "metakv", certs, voters=3)   # a local_cluster.Cluster
    etcd = start_etcd_tls(root / "etcd", certs, members=3)           # a clusters.LocalCluster

Both are stopped as their plain twins are (``close()``, ``stop()``), only by pid.
"""

from __future__ import annotations

import dataclasses
import os
import ssl
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from app.certs import make_certs
from app.tls import TlsFiles, node_name
from loadtest.clusters import ClusterError, LocalCluster, etcd_binary
from loadtest.local_cluster import DEFAULT_WAIT_S, Cluster, Node, free_ports


@dataclasses.dataclass
class HttpsNode(Node):
    """A node serving HTTPS on its HTTP port."""

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.http_port}"


def make_cluster_certs(directory: Path, nodes: int) -> Path:
    """A CA and node-1 .. node-N certificates in ``directory`` (made once, reused after)."""
    if not (directory / "ca.crt").exists():
        make_certs(directory, range(1, nodes + 1))
    return directory


def node_files(certs: Path, node_id: int) -> TlsFiles:
    name = node_name(node_id)
    return TlsFiles(certs / f"{name}.crt", certs / f"{name}.key", certs / "ca.crt")


def client_context(certs: Path, client_cert: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    """Trusts the cluster's CA; presents ``client_cert`` (certificate, key) when given."""
    context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    if client_cert is not None:
        context.load_cert_chain(*client_cert)
    return context


class TlsCluster(Cluster):
    """A local_cluster.Cluster whose nodes serve HTTPS and speak peer mutual TLS; its shared
    client trusts the cluster's CA (and presents ``client_cert`` when given)."""

    def __init__(self, root: Path, certs: Path, voters: int = 3, *, settings: Mapping[str, Any] | None = None,
                 client_cert: tuple[Path, Path] | None = None, **kwargs: Any) -> None:
        super().__init__(root, voters, settings=settings, **kwargs)
        self.certs = certs
        self.client_cert = client_cert
        for node_id, node in list(self.nodes.items()):
            files = node_files(certs, node_id)
            node.command += ["--tls-cert-file", str(files.cert_file), "--tls-key-file", str(files.key_file),
                             "--peer-tls-cert-file", str(files.cert_file), "--peer-tls-key-file", str(files.key_file),
                             "--peer-tls-ca-file", str(files.ca_file)]
            self.nodes[node_id] = HttpsNode(**{field.name: getattr(node, field.name)
                                               for field in dataclasses.fields(node)})

    def client(self) -> httpx.Client:
        if self._client is None:
            self._client = httpx.Client(timeout=10.0, verify=client_context(self.certs, self.client_cert))
        return self._client


def start_etcd_tls(base: Path, certs: Path, members: int = 3) -> LocalCluster:
    """etcd with https client and peer URLs, client and peer certificate auth by the same CA
    (like metakv's --tls-client-ca-file off: clients need no certificate; peers do)."""
    binary = etcd_binary()
    base.mkdir(parents=True, exist_ok=True)
    ports = free_ports(2 * members)
    initial = ",".join(f"e{i + 1}=https://127.0.0.1:{ports[members + i]}" for i in range(members))
    nodes: dict[int, Node] = {}
    for index in range(members):
        files = node_files(certs, index + 1)
        client_url, peer_url = f"https://127.0.0.1:{ports[index]}", f"https://127.0.0.1:{ports[members + index]}"
        command = [binary, "--name", f"e{index + 1}", "--data-dir", str(base / f"e{index + 1}"),
                   "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                   "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                   "--initial-cluster", initial, "--initial-cluster-state", "new",
                   "--initial-cluster-token", f"tls-{base.name}",
                   "--cert-file", str(files.cert_file), "--key-file", str(files.key_file),
                   "--peer-cert-file", str(files.cert_file), "--peer-key-file", str(files.key_file),
                   "--peer-trusted-ca-file", str(files.ca_file), "--peer-client-cert-auth"]
        nodes[index + 1] = HttpsNode(index + 1, ports[index], ports[members + index], base / f"e{index + 1}",
                                     base / f"e{index + 1}.log", command=command, env=dict(os.environ))
    cluster = LocalCluster("etcd", nodes, base, keep_dir=True)
    try:
        for node in nodes.values():
            node.start()
        _wait_etcd_healthy(cluster, client_context(certs))
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_etcd_healthy(cluster: LocalCluster, context: ssl.SSLContext) -> None:
    deadline = time.monotonic() + DEFAULT_WAIT_S
    with httpx.Client(verify=context, timeout=2.0) as client:
        while time.monotonic() < deadline:
            healthy = 0
            for node in cluster.nodes.values():
                try:
                    healthy += client.get(f"{node.url}/health").json().get("health") == "true"
                except (httpx.HTTPError, ValueError):
                    pass
            if healthy == len(cluster.nodes):
                return
            time.sleep(0.2)
    raise ClusterError(f"etcd with TLS did not become healthy within {DEFAULT_WAIT_S} s; logs in {cluster.base_dir}")


def etcd_leader(cluster: LocalCluster, context: ssl.SSLContext) -> Node:
    """The member that leads, asked over https."""
    with httpx.Client(verify=context, timeout=2.0) as client:
        for node in cluster.nodes.values():
            status = client.post(f"{node.url}/v3/maintenance/status", json={}).json()
            if status.get("leader") == status["header"]["member_id"]:
                return node
    raise ClusterError("no etcd member leads")
