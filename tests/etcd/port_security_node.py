"""The etcd port of a real follower with HTTPS (a client certificate required) and a token file:
etcdctl with --cacert/--cert/--key works over gRPC and the JSON gateway answers over HTTPS,
both on the one port; a plaintext client and a TLS client without a certificate are refused;
etcdctl --user name:secret gets the token's rights (its writes forwarded to the leader), a
certificate naming a token its rights on what the follower serves itself."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from loadtest.tls_clusters import TlsCluster, client_context
from tests.security.certs_fixture import CertSet, make_test_certs

pytestmark = pytest.mark.skipif(shutil.which("etcdctl") is None, reason="etcdctl comes from `make system-etcd`")
COMMAND_TIMEOUT = "--command-timeout=5s"
REFUSED_TIMEOUT = "--command-timeout=1s"  # etcdctl retries a refused handshake until then


@dataclass
class SecureNode:
    cluster: TlsCluster
    certs: CertSet
    endpoint: str  # host:port of the etcd port

    def etcdctl(self, *args: str, client: str | None = "root", tls: bool = True, user: str | None = "root:root-secret",
                timeout: str = COMMAND_TIMEOUT) -> subprocess.CompletedProcess[str]:
        flags = [f"--endpoints={'https' if tls else 'http'}://{self.endpoint}", timeout, "--dial-timeout=2s"]
        if user is not None:
            flags.append(f"--user={user}")
        if tls:
            flags.append(f"--cacert={self.certs.ca}")
        if client is not None:
            cert, key = self.certs.client(client)
            flags += [f"--cert={cert}", f"--key={key}"]
        return subprocess.run(["etcdctl", *flags, *args], capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureNode]:
    """A follower of 3 voters, each serving gRPC and the gateway on its one etcd port: its
    writes are forwarded to the leader over HTTPS with the caller's token."""
    root = Path(tmp_path_factory.mktemp("etcd-port-security"))
    certs = make_test_certs(root / "certs", range(1, 4), ("root", "stranger"))
    tokens = root / "tokens.toml"
    tokens.write_text("".join(f'[[tokens]]\nname = "{name}"\nsha256 = "{hashlib.sha256(secret.encode()).hexdigest()}"\n'
                              f"[tokens.rules]\n{rules}\n" for name, secret, rules in (
                                  ("root", "root-secret", '"" = "admin"'), ("reader", "reader-secret", '"tls/" = "read"'))))
    cluster = TlsCluster(root / "cluster", certs.directory, 3, client_cert=certs.client("root"), token="root-secret",
                         etcd=True, settings={"tls_client_ca_file": certs.ca, "auth_file": tokens})
    for member in cluster.nodes.values():  # one port: no separate gateway
        at = member.command.index("--listen-etcd-gateway")
        del member.command[at:at + 2]
    try:
        cluster.start()
        leader = cluster.wait_for_leader()
        follower = next(member for member in cluster.nodes.values() if member.node_id != leader.node_id)
        cluster.wait_ready(follower)
        yield SecureNode(cluster, certs, f"127.0.0.1:{follower.etcd_port}")
    finally:
        cluster.close()


def test_etcdctl_over_tls_with_a_client_certificate(node: SecureNode) -> None:
    put = node.etcdctl("put", "tls/a", "1")
    assert put.returncode == 0 and put.stdout.strip() == "OK", put.stderr
    got = node.etcdctl("get", "tls/a")
    assert got.stdout.splitlines() == ["tls/a", "1"], got.stderr


def test_the_gateway_answers_https_on_the_same_port(node: SecureNode) -> None:
    node.etcdctl("put", "tls/b", "2")
    with httpx.Client(verify=client_context(node.certs.directory, node.certs.client("root")), timeout=10) as https:
        got = https.post(f"https://{node.endpoint}/v3/kv/range", json={"key": base64.b64encode(b"tls/b").decode()},
                         headers={"Authorization": "root-secret"})
    assert base64.b64decode(got.json()["kvs"][0]["value"]) == b"2"


def test_plaintext_and_certificate_less_clients_are_refused(node: SecureNode) -> None:
    plain = node.etcdctl("get", "tls/a", client=None, tls=False, timeout=REFUSED_TIMEOUT)
    assert plain.returncode != 0 and "tls/a" not in plain.stdout
    anonymous = node.etcdctl("get", "tls/a", client=None, timeout=REFUSED_TIMEOUT)
    assert anonymous.returncode != 0 and "tls/a" not in anonymous.stdout
    with httpx.Client(verify=client_context(node.certs.directory), timeout=10) as no_cert, \
            pytest.raises(httpx.TransportError):
        no_cert.post(f"https://{node.endpoint}/v3/kv/range", json={"key": base64.b64encode(b"tls/a").decode()})
    with pytest.raises(httpx.TransportError):  # plain HTTP to a TLS port: the handshake fails, nothing answers
        httpx.post(f"http://{node.endpoint}/v3/kv/range", json={"key": "dGxzL2E="}, timeout=10).raise_for_status()


def test_etcdctl_user_gets_its_tokens_rights(node: SecureNode) -> None:
    node.etcdctl("put", "tls/c", "3")
    got = node.etcdctl("get", "tls/c", client="stranger", user="reader:reader-secret")
    assert got.stdout.splitlines() == ["tls/c", "3"], got.stderr
    put = node.etcdctl("put", "tls/c", "4", client="stranger", user="reader:reader-secret")
    assert put.returncode != 0 and "etcdserver: permission denied" in put.stderr
    other = node.etcdctl("get", "elsewhere", client="stranger", user="reader:reader-secret")
    assert other.returncode != 0 and "etcdserver: permission denied" in other.stderr
    wrong = node.etcdctl("get", "tls/c", client="stranger", user="reader:guess")
    assert wrong.returncode != 0 and "authentication failed, invalid user ID or password" in wrong.stderr
    anonymous = node.etcdctl("get", "tls/c", client="stranger", user=None)  # a certificate naming no token
    assert anonymous.returncode != 0 and "etcdserver: user name is empty" in anonymous.stderr


def test_a_certificate_naming_a_token_reads_locally_but_is_not_forwarded_for(node: SecureNode) -> None:
    """The certificate of client "root" names the token root: the follower serves its
    serializable reads, but has no secret to forward its writes with (docs/etcd.md, Auth)."""
    node.etcdctl("put", "tls/d", "5")
    local = node.etcdctl("get", "tls/d", "--consistency=s", user=None)
    assert local.stdout.splitlines() == ["tls/d", "5"], local.stderr
    forwarded = node.etcdctl("put", "tls/d", "6", user=None)
    assert forwarded.returncode != 0 and "etcdserver: permission denied" in forwarded.stderr


def test_member_list_names_every_members_client_url_with_tls_and_auth_on(node: SecureNode) -> None:
    """The follower asks each member's /v1/status for its etcd URL with the caller's token
    and the cluster's CA: no member may drop out of the list for lack of either."""
    listed = node.etcdctl("member", "list", "-w", "json")
    members = json.loads(listed.stdout)["members"]
    assert len(members) == 3, listed.stderr
    assert all(member.get("clientURLs") for member in members), members
    # every member speaks TLS on its etcd port (the others' URLs said http:// before)
    assert all(url.startswith("https://") for member in members for url in member["clientURLs"]), members
