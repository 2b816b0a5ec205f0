"""Safe defaults: a node reachable from other machines does not start on the public built-in
secret (or a short one) without peer TLS, unless --insecure says the operator means it; on
loopback nothing is asked for. The refusal is one line and exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.cli import main
from app.config import DEFAULT_CLUSTER_SECRET, ConfigError, build_node_config
from tests.security.certs_fixture import CertSet


def flags(tmp_path: Path, host: str, **extra: object) -> dict[str, object]:
    return {"node_id": "1", "data_dir": str(tmp_path / "data"), "listen_http": f"{host}:18001",
            "listen_raft": f"{host}:18002", "voters": f"1@{host}:18002", **extra}


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    for name in [name for name in os.environ if name.startswith("METAKV_")]:
        monkeypatch.delenv(name)


def test_loopback_needs_nothing(tmp_path: Path, clean_env: None) -> None:
    assert build_node_config(flags(tmp_path, "127.0.0.1")).cluster_secret == DEFAULT_CLUSTER_SECRET
    assert build_node_config(flags(tmp_path, "localhost")).insecure is False


@pytest.mark.parametrize(("secret", "why"), [
    (None, "the cluster secret is the public built-in one"),
    ("short-secret", "fewer than 16 characters"),
])
def test_a_network_listener_refuses_a_public_or_short_secret(
        tmp_path: Path, clean_env: None, secret: str | None, why: str, capsys: pytest.CaptureFixture[str]) -> None:
    extra = {"cluster_secret": secret} if secret else {}
    with pytest.raises(ConfigError, match=why):
        build_node_config(flags(tmp_path, "0.0.0.0", **extra))
    argv = ["serve", "--node-id", "1", "--data-dir", str(tmp_path / "data"), "--listen-http", "0.0.0.0:18001",
            "--listen-raft", "0.0.0.0:18002", "--voters", "1@127.0.0.1:18002"]
    assert main(argv + (["--cluster-secret", secret] if secret else [])) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and why in lines[0] and "--insecure" in lines[0], lines
    assert not (tmp_path / "data").exists()


def test_insecure_a_strong_secret_or_peer_tls_lets_it_start(tmp_path: Path, clean_env: None, certs: CertSet) -> None:
    assert build_node_config(flags(tmp_path, "0.0.0.0", insecure=True)).insecure
    assert build_node_config(flags(tmp_path, "0.0.0.0", cluster_secret="x" * 16))
    node = certs.node(1)
    config = build_node_config(flags(tmp_path, "0.0.0.0", peer_tls_cert_file=str(node.cert_file),
                                     peer_tls_key_file=str(node.key_file), peer_tls_ca_file=str(node.ca_file)))
    assert config.peer_tls == node


def test_tls_settings_are_checked_before_anything_starts(tmp_path: Path, clean_env: None, certs: CertSet) -> None:
    node = certs.node(1)
    with pytest.raises(ConfigError, match="give all three or none"):
        build_node_config(flags(tmp_path, "127.0.0.1", peer_tls_cert_file=str(node.cert_file)))
    with pytest.raises(ConfigError, match="give both or neither"):
        build_node_config(flags(tmp_path, "127.0.0.1", tls_cert_file=str(node.cert_file)))
    with pytest.raises(ConfigError, match="TLS: certificate .* with key"):
        build_node_config(flags(tmp_path, "127.0.0.1", tls_cert_file=str(node.cert_file),
                                tls_key_file=str(certs.node(2).key_file)))  # a key that does not match
    with pytest.raises(ConfigError, match="advertise an https:// URL"):
        build_node_config(flags(tmp_path, "127.0.0.1", tls_cert_file=str(node.cert_file),
                                tls_key_file=str(node.key_file), advertise_http="http://127.0.0.1:18001"))
    https = build_node_config(flags(tmp_path, "127.0.0.1", tls_cert_file=str(node.cert_file),
                                    tls_key_file=str(node.key_file)))
    assert https.advertise_http == "https://127.0.0.1:18001"
    with pytest.raises(ConfigError, match="node 1 is a voter"):
        build_node_config(flags(tmp_path, "127.0.0.1", allowed_observers="1,4"))
