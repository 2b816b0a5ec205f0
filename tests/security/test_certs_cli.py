"""`metakv certs`: a CA and node certificates a node accepts as its peer TLS settings, keys
readable by the owner only, and never an overwritten file."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from app.config import build_node_config
from app.tls import node_id_of
from tests.cluster import REPO_ROOT


def run_certs(*args: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("METAKV_")}
    return subprocess.run([sys.executable, "-m", "app.cli", "certs", *args], capture_output=True, text=True,
                          cwd=REPO_ROOT, env=env, timeout=60)


def test_certs_makes_what_a_node_needs_and_never_overwrites(tmp_path: Path) -> None:
    directory = tmp_path / "certs"
    made = run_certs("--dir", str(directory), "--nodes", "1,2", "--clients", "ops")
    assert made.returncode == 0, made.stderr
    names = sorted(Path(line).name for line in made.stdout.split())
    assert names == ["ca.crt", "ca.key", "client-ops.crt", "client-ops.key",
                     "node-1.crt", "node-1.key", "node-2.crt", "node-2.key"]
    assert stat.S_IMODE((directory / "ca.key").stat().st_mode) == 0o600
    config = build_node_config({
        "node_id": "1", "data_dir": str(tmp_path / "data"), "listen_http": "127.0.0.1:18001",
        "listen_raft": "127.0.0.1:18002", "voters": "1@127.0.0.1:18002",
        "peer_tls_cert_file": str(directory / "node-1.crt"), "peer_tls_key_file": str(directory / "node-1.key"),
        "peer_tls_ca_file": str(directory / "ca.crt"), "tls_cert_file": str(directory / "node-1.crt"),
        "tls_key_file": str(directory / "node-1.key")}, environ={})
    assert config.advertise_http.startswith("https://")
    # A node added later is issued by the same CA; an existing file is refused with exit 2.
    assert run_certs("--dir", str(directory), "--nodes", "3").returncode == 0
    again = run_certs("--dir", str(directory), "--nodes", "3")
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "node-3.crt exists" in again.stderr


def test_a_node_certificate_names_its_node_once() -> None:
    assert node_id_of({"subject": ((("commonName", "node-7"),),), "subjectAltName": (("DNS", "node-7"),)}) == 7
    assert node_id_of({"subject": ((("commonName", "node-7"),),), "subjectAltName": (("DNS", "node-8"),)}) is None
    assert node_id_of({"subject": ((("commonName", "ops"),),)}) is None
    assert node_id_of({}) is None


def test_a_client_name_that_is_a_node_name_or_a_path_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """A client certificate named node-3 (clientAuth, from the cluster's CA) would be let onto
    the raft port as node 3; a name with a slash wrote outside --dir or crashed half-way."""
    for client, why in (("node-3", "would connect to the raft port as node 3"), ("a/b", "a file name")):
        directory = tmp_path / client.replace("/", "_")
        refused = run_certs("--dir", str(directory), "--nodes", "1", "--clients", client)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and why in refused.stderr, refused.stderr
        assert not directory.exists() or list(directory.iterdir()) == []
