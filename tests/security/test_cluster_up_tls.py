"""`metakv cluster up --tls`: certificates made under the data directory, every node on HTTPS
with peer mutual TLS, the leader line an https URL, and `metakv status --cacert` reading the
quorum over HTTPS."""

from __future__ import annotations

import os
import ssl
import uuid
from pathlib import Path

import httpx

from loadtest.local_cluster import free_ports
from tests.app.test_cli import cluster_up, run_cli


def test_cluster_up_tls_serves_https_with_peer_tls(tmp_path: Path) -> None:
    http_port, raft_port = free_ports(2)
    env = {**{key: value for key, value in os.environ.items() if not key.startswith("METAKV_")},
           "METAKV_CLUSTER_ID": f"cli-tls-{uuid.uuid4().hex[:12]}"}
    args = ["--voters", "1", "--observers", "0", "--base-http-port", str(http_port),
            "--base-raft-port", str(raft_port), "--data-dir", str(tmp_path / "data"), "--tls"]
    with cluster_up(args, env) as (process, text, run):
        url = f"https://127.0.0.1:{http_port}"
        ca = tmp_path / "data" / "certs" / "ca.crt"
        assert f"leader: {url}" in text and f"--cacert {ca}" in text, text
        node_command = Path(f"/proc/{run.node_pids()[0]}/cmdline").read_bytes().split(b"\0")
        assert b"--peer-tls-ca-file" in node_command and b"--tls-cert-file" in node_command
        assert httpx.put(f"{url}/v1/kv/tls", content=b"1", verify=ssl.create_default_context(cafile=str(ca)),
                         timeout=10).status_code == 200
        status = run_cli(["status", "--url", url, "--cacert", str(ca)], env=env)
        assert status.returncode == 0 and "leader" in status.stdout, status.stderr
        plain = run_cli(["status", "--url", url], env=env)  # the system CAs do not know this one
        assert plain.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in plain.stderr
    assert process.returncode == 0
