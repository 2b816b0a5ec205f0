"""docker-compose.yml, run without Docker: each service's entrypoint + command + environment
becomes a local process (ports remapped to free ones, hostnames to 127.0.0.1, /data to a temp
dir). Proves the compose file alone configures a cluster that forms, elects a leader, passes
its healthcheck and serves a write."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import yaml

from tests.cluster import REPO_ROOT, Cluster, Node, free_ports

COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"


def _expand(value: str, environ: dict[str, str]) -> str:
    """Compose's ${NAME:-default} interpolation."""
    def replace(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(3) or ""
        return environ.get(name) or default
    return re.sub(r"\$\{([A-Z0-9_]+)(:-([^}]*))?\}", replace, value)


def _node_services(compose: dict) -> dict[str, dict]:
    """The services `docker compose up` starts: those outside any profile (the Locust
    services of the `loadtest` profile are tested in tests/loadtest/test_compose_profile.py)."""
    return {name: service for name, service in compose["services"].items() if not service.get("profiles")}


def _local_nodes(compose: dict, root: Path) -> list[Node]:
    services: dict[str, dict] = _node_services(compose)
    ports = free_ports(4 * len(services))
    etcd_ports = iter(ports[2 * len(services):])  # the etcd API and its gateway
    local_http: dict[str, int] = {}
    local_raft: dict[str, int] = {}
    for index, name in enumerate(services):
        local_http[name], local_raft[name] = ports[2 * index], ports[2 * index + 1]
    run_id = uuid.uuid4().hex[:12]
    nodes = []
    for name, service in services.items():
        environment = {key: _expand(str(value), {}) for key, value in service["environment"].items()}
        assert all(key.startswith("METAKV_") for key in environment), "configured only through METAKV_*"
        container_http = int(environment["METAKV_LISTEN_HTTP"].rsplit(":", 1)[1])
        host_address, host_port, container_port = service["ports"][0].split(":")
        assert host_address == "127.0.0.1", "a public default secret: publish on loopback only"
        container_port = int(container_port)
        assert container_port == container_http
        # Hostnames of the compose network -> loopback with each service's own local port.
        voters = environment["METAKV_VOTERS"]
        for other in services:
            voters = voters.replace(f"{other}:{environment['METAKV_LISTEN_RAFT'].rsplit(':', 1)[1]}",
                                    f"127.0.0.1:{local_raft[other]}")
        environment.update({
            "METAKV_VOTERS": voters,
            "METAKV_LISTEN_HTTP": f"127.0.0.1:{local_http[name]}",
            "METAKV_LISTEN_RAFT": f"127.0.0.1:{local_raft[name]}",
            "METAKV_ADVERTISE_HTTP": environment["METAKV_ADVERTISE_HTTP"].replace(
                f"localhost:{host_port}", f"127.0.0.1:{local_http[name]}"),
            "METAKV_DATA_DIR": str(root / name),
            **{setting: f"127.0.0.1:{next(etcd_ports)}" for setting in ("METAKV_LISTEN_ETCD", "METAKV_LISTEN_ETCD_GATEWAY")
               if setting in environment},
            # Other clusters run on this machine at once: a unique id keeps their nodes apart.
            "METAKV_CLUSTER_ID": f"{environment['METAKV_CLUSTER_ID']}-{run_id}",
        })
        assert service["entrypoint"] == ["metakv"]
        command = [sys.executable, "-m", "app.cli", *service["command"]]
        env = {key: value for key, value in os.environ.items() if not key.startswith("METAKV_")}
        env.update(environment, PYTHONUNBUFFERED="1")
        node_id = int(environment["METAKV_NODE_ID"])
        nodes.append(Node(node_id, local_http[name], local_raft[name], root / name, root / f"{name}.log",
                          observer=environment.get("METAKV_OBSERVER") == "true", command=command, env=env))
    return nodes


def _healthcheck_passes(service: dict, node: Node) -> bool:
    """Run the service's healthcheck command against the local port instead of 8001."""
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1] == "python"
    script = test[3].replace("127.0.0.1:8001", f"127.0.0.1:{node.http_port}")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=30).returncode == 0


def test_compose_services_form_a_cluster_that_serves_a_write(tmp_path: Path) -> None:
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    services = _node_services(compose)
    assert len(services) == 4
    assert set(compose["volumes"]) == {volume.split(":")[0] for s in services.values() for volume in s["volumes"]}
    nodes = _local_nodes(compose, tmp_path)
    assert sorted(node.observer for node in nodes) == [False, False, False, True]
    cluster = Cluster(tmp_path / "unused", voters=0, observers=0)
    cluster.nodes = {node.node_id: node for node in nodes}
    try:
        cluster.start()
        leader = cluster.wait_for_leader()
        assert not leader.observer
        for node in nodes:
            cluster.wait_ready(node)
        for name, node in zip(services, nodes, strict=True):
            assert _healthcheck_passes(services[name], node), name
        observer = next(node for node in nodes if node.observer)
        response = httpx.put(f"{observer.url}/v1/kv/compose/hello", content=b"world", follow_redirects=True,
                             timeout=10)
        assert response.status_code == 200, response.text
        version = response.json()["version"]
        for node in nodes:
            read = httpx.get(f"{node.url}/v1/kv/compose/hello", params={"min_version": version}, timeout=10)
            assert read.status_code == 200 and read.content == b"world"
    finally:
        print(cluster.logs())
        cluster.close()
