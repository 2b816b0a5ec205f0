"""The `tls` profile of docker-compose.yml, run without Docker: each service's command and
environment becomes a local process (ports remapped to free ones, hostnames to 127.0.0.1,
/certs to certificates `metakv certs` made, /data to a temp dir). Proves the profile alone
configures a cluster with HTTPS and peer mutual TLS that forms, passes its healthcheck and
serves a write."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import yaml

from app.certs import make_certs
from loadtest.local_cluster import free_ports
from loadtest.tls_clusters import HttpsNode, TlsCluster
from tests.cluster import REPO_ROOT

COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"


def tls_services() -> dict[str, dict]:
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    return {name: service for name, service in compose["services"].items() if service.get("profiles") == ["tls"]}


def local_node(name: str, service: dict, ports: dict[str, tuple[int, int]], certs: Path, root: Path,
               run_id: str) -> HttpsNode:
    environment = {key: str(value) for key, value in service["environment"].items()}
    assert all(key.startswith("METAKV_") for key in environment), "configured only through METAKV_*"
    voters = environment["METAKV_VOTERS"]
    for other, (_, raft_port) in ports.items():
        voters = voters.replace(f"{other}:9001", f"127.0.0.1:{raft_port}")
    http_port, raft_port = ports[name]
    host_port = service["ports"][0].split(":")[1]
    environment = {key: value.replace("/certs/", f"{certs}/") for key, value in environment.items()}
    environment.update({
        "METAKV_VOTERS": voters, "METAKV_LISTEN_HTTP": f"127.0.0.1:{http_port}",
        "METAKV_LISTEN_RAFT": f"127.0.0.1:{raft_port}", "METAKV_DATA_DIR": str(root / name),
        "METAKV_ADVERTISE_HTTP": environment["METAKV_ADVERTISE_HTTP"].replace(
            f"localhost:{host_port}", f"127.0.0.1:{http_port}"),
        "METAKV_CLUSTER_ID": f"{environment['METAKV_CLUSTER_ID']}-{run_id}",
    })
    env = {key: value for key, value in os.environ.items() if not key.startswith("METAKV_")}
    env.update(environment, PYTHONUNBUFFERED="1")
    return HttpsNode(int(environment["METAKV_NODE_ID"]), http_port, raft_port, root / name, root / f"{name}.log",
                     command=[sys.executable, "-m", "app.cli", *service["command"]], env=env)


def test_the_tls_profile_forms_a_cluster_that_serves_over_https(tmp_path: Path) -> None:
    services = tls_services()
    assert len(services) == 3
    certs = tmp_path / "certs"
    make_certs(certs, [1, 2, 3])  # what the profile's comment says to run first
    free = free_ports(2 * len(services))
    ports = {name: (free[2 * i], free[2 * i + 1]) for i, name in enumerate(services)}
    run_id = uuid.uuid4().hex[:12]  # other clusters run on this machine at once: their own id
    nodes = [local_node(name, service, ports, certs, tmp_path, run_id) for name, service in services.items()]
    cluster = TlsCluster(tmp_path / "unused", certs, voters=0)
    cluster.nodes = {node.node_id: node for node in nodes}
    try:
        cluster.start()
        leader = cluster.wait_for_leader()
        for (name, service), node in zip(services.items(), nodes, strict=True):
            cluster.wait_ready(node)
            test = service["healthcheck"]["test"]
            script = test[3].replace("localhost:8001", f"localhost:{node.http_port}").replace("/certs/", f"{certs}/")
            assert subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=30).returncode == 0, name
        response = cluster.client().put(f"{leader.url}/v1/kv/compose/tls", content=b"1")
        assert response.status_code == 200 and response.url.scheme == "https"
    finally:
        cluster.close()
