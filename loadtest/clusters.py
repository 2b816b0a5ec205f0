"""Fresh local clusters for one load-test run: 3 metakv voters or 3 etcd members.
A ``metakv-etcd`` cluster is 3 metakv voters spoken to through their etcd v3 JSON gateways
(``--listen-etcd-gateway``): the same scenarios through metakv's etcd API.

Both run as real processes on free loopback ports with their data in a temporary
directory, so each run starts from an empty store and leaves nothing behind. The processes
themselves (ports, start, SIGTERM/SIGKILL by pid, log files) are ``loadtest.local_cluster``'s
``Node``s; a metakv cluster is a ``local_cluster.Cluster``'s nodes. This module adds what a
run needs on top, for either kind: wait until ready, find the leader, SIGKILL it mid-run
to measure a failover, stop gracefully and remove the data.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.local_cluster import Cluster, Node, free_ports
from raft.types import check

CLUSTER_START_TIMEOUT_S = 60.0  # until every node answers and a leader is known
HTTP_PROBE_TIMEOUT_S = 2.0
NODES_DEFAULT = 3
LOG_TAIL_ON_ERROR_BYTES = 800
CLUSTER_TARGETS = ("metakv", "metakv-etcd", "etcd")  # the kinds of cluster a run can start


class ClusterError(RuntimeError):
    """The cluster could not be started; the message names the node and its log file."""


@dataclass
class LocalCluster:
    kind: str  # "metakv" | "metakv-etcd" | "etcd"
    nodes: dict[int, Node]
    base_dir: Path
    keep_dir: bool = False
    killed: list[int] = field(default_factory=list)

    @property
    def endpoints(self) -> list[str]:
        """Where the load goes: a metakv-etcd cluster's etcd gateways, else the nodes' URLs."""
        if self.kind == "metakv-etcd":
            return [f"http://127.0.0.1:{node.etcd_gateway_port}" for node in self.nodes.values()]
        return [node.url for node in self.nodes.values()]

    @property
    def metrics_endpoints(self) -> list[str]:
        """Each node's URL serving /metrics (a metakv node's HTTP API, an etcd member's client URL)."""
        return [node.url for node in self.nodes.values()]

    def leader(self) -> Node | None:
        """The node that currently says it leads (asked of every live node)."""
        for node in self.nodes.values():
            if not node.running():
                continue
            if self.kind == "etcd":
                status = _post_json(node.url + "/v3/maintenance/status", {})
                if status and status.get("leader") and status["leader"] == status["header"]["member_id"]:
                    return node
            else:
                status = _get_json(node.url + "/v1/status")
                if status and str(status.get("role", "")).lower() == "leader":
                    return node
        return None

    def kill(self, node: Node) -> None:
        """SIGKILL: the node gets no chance to resign or flush."""
        node.kill()
        self.killed.append(node.node_id)

    def stop(self) -> None:
        """SIGTERM to every node at once (a metakv leader resigns first), then wait for each."""
        for node in self.nodes.values():
            node.signal(signal.SIGTERM)
        for node in self.nodes.values():
            node.stop()
        if not self.keep_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def version(self) -> str:
        if self.kind == "etcd":
            first = next(iter(self.nodes.values()))
            status = _post_json(first.url + "/v3/maintenance/status", {})
            return str(status.get("version", "")) if status else ""
        return _metakv_version()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop()


def etcd_binary() -> str:
    found = shutil.which("etcd")
    if found is None:
        raise ClusterError("etcd is not installed: run `make system` (installs Debian's etcd-server)")
    return found


def start_etcd(nodes: int = NODES_DEFAULT, base_dir: Path | None = None,
               extra_flags: Sequence[str] = ()) -> LocalCluster:
    """A fresh etcd cluster of ``nodes`` members on loopback (fsync on, as in production),
    each started with ``extra_flags`` too (quota, compaction). A member's ``raft_port`` is
    its peer port (etcd's own raft traffic)."""
    binary = etcd_binary()
    base = _base_dir(base_dir, "loadtest-etcd-")
    ports = free_ports(2 * nodes)
    client_ports, peer_ports = ports[:nodes], ports[nodes:]
    initial = ",".join(f"e{i + 1}=http://127.0.0.1:{peer_ports[i]}" for i in range(nodes))
    members: dict[int, Node] = {}
    for index in range(nodes):
        name = f"e{index + 1}"
        client_url = f"http://127.0.0.1:{client_ports[index]}"
        peer_url = f"http://127.0.0.1:{peer_ports[index]}"
        data_dir = base / name
        command = [
            binary, "--name", name, "--data-dir", str(data_dir),
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", initial, "--initial-cluster-state", "new",
            "--initial-cluster-token", f"loadtest-{base.name}", *extra_flags,
        ]
        members[index + 1] = Node(index + 1, client_ports[index], peer_ports[index], data_dir, base / f"{name}.log",
                                  command=command, env=dict(os.environ))
    return _started(LocalCluster("etcd", members, base, keep_dir=base_dir is not None))


def start_metakv(nodes: int = NODES_DEFAULT, base_dir: Path | None = None, etcd_gateway: bool = False
                 ) -> LocalCluster:
    """A fresh metakv cluster of ``nodes`` voters on loopback, one `metakv serve` each
    (``local_cluster.Cluster``'s nodes: its own cluster id, so it never joins another);
    ``etcd_gateway``: each also serves etcd's v3 API and gateway, and the load goes there."""
    base = _base_dir(base_dir, "loadtest-metakv-")
    voters = Cluster(base, voters=nodes, etcd=etcd_gateway).nodes
    kind = "metakv-etcd" if etcd_gateway else "metakv"
    return _started(LocalCluster(kind, voters, base, keep_dir=base_dir is not None))


def start_cluster(kind: str, nodes: int = NODES_DEFAULT, base_dir: Path | None = None) -> LocalCluster:
    if kind == "etcd":
        return start_etcd(nodes, base_dir)
    if kind in ("metakv", "metakv-etcd"):
        return start_metakv(nodes, base_dir, etcd_gateway=kind == "metakv-etcd")
    raise ValueError(f"unknown cluster kind {kind!r} (metakv, metakv-etcd or etcd)")


def _base_dir(base_dir: Path | None, prefix: str) -> Path:
    base = Path(base_dir) if base_dir else Path(tempfile.mkdtemp(prefix=prefix))
    base.mkdir(parents=True, exist_ok=True)
    return base


def _started(cluster: LocalCluster) -> LocalCluster:
    """Start every node and wait until all answer and one leads; on failure stop them all."""
    try:
        for node in cluster.nodes.values():
            node.start()
        _wait_ready(cluster)
        return cluster
    except BaseException:
        cluster.stop()
        raise


def _wait_ready(cluster: LocalCluster) -> None:
    deadline = time.monotonic() + CLUSTER_START_TIMEOUT_S
    pending = list(cluster.nodes.values())
    while time.monotonic() < deadline:
        for node in list(pending):
            if not node.running():
                tail = node.log_tail(LOG_TAIL_ON_ERROR_BYTES)
                raise ClusterError(f"{cluster.kind} node {node.node_id} exited ({node.log_path}): {tail}")
            if _node_ready(cluster.kind, node):
                pending.remove(node)
        if not pending and cluster.leader() is not None:
            return
        time.sleep(0.2)
    names = ", ".join(f"node {node.node_id} ({node.log_path})" for node in pending) or "no leader"
    raise ClusterError(f"{cluster.kind} cluster not ready after {CLUSTER_START_TIMEOUT_S:.0f}s: {names}")


def _node_ready(kind: str, node: Node) -> bool:
    if kind == "etcd":
        health = _get_json(node.url + "/health")
        return bool(health) and str(health.get("health")) == "true"
    try:
        with urllib.request.urlopen(node.url + "/readyz", timeout=HTTP_PROBE_TIMEOUT_S) as response:
            if response.status != 200:
                return False
    except (OSError, urllib.error.URLError):
        return False
    return kind != "metakv-etcd" or _get_json(f"http://127.0.0.1:{node.etcd_gateway_port}/version") is not None


def _get_json(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=HTTP_PROBE_TIMEOUT_S) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None


def _post_json(url: str, document: dict[str, Any]) -> dict[str, Any] | None:
    request = urllib.request.Request(url, data=json.dumps(document).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=HTTP_PROBE_TIMEOUT_S) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None


def fetch_text(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=HTTP_PROBE_TIMEOUT_S * 5) as response:
            return response.read().decode("utf-8", "replace")
    except OSError:
        return None


def _metakv_version() -> str:
    try:
        from importlib.metadata import version

        return version("metakv")
    except Exception:  # noqa: BLE001 - the version is informative only
        return ""


def cluster_summary(cluster: LocalCluster) -> dict[str, Any]:
    check(len(cluster.nodes) > 0, "a cluster has nodes")
    return {
        "kind": cluster.kind,
        "nodes": len(cluster.nodes),
        "endpoints": cluster.endpoints,
        "version": cluster.version(),
        "killed": list(cluster.killed),
    }
