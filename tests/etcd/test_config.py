"""The etcd listeners' settings: refused where they cannot serve, clear otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.config import ConfigError, build_node_config


def test_the_etcd_api_serves_beside_token_auth_and_the_gateway_needs_it(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[[tokens]]\nname = "ops"\nsha256 = "' + "0" * 64 + '"\nrules = { "" = "admin" }\n')
    base = {"node_id": "1", "data_dir": str(tmp_path), "listen_http": "127.0.0.1:8001",
            "listen_raft": "127.0.0.1:9001", "voters": "1@127.0.0.1:9001"}
    with_auth = build_node_config({**base, "listen_etcd": "127.0.0.1:2379", "auth_file": str(tokens)}, environ={})
    assert with_auth.listen_etcd is not None and with_auth.auth_policy is not None
    with pytest.raises(ConfigError, match="--listen-etcd-gateway: needs --listen-etcd"):
        build_node_config({**base, "listen_etcd_gateway": "127.0.0.1:12379"}, environ={})
    config = build_node_config({**base, "listen_etcd": "127.0.0.1:2379"}, environ={})
    assert config.listen_etcd is not None and config.listen_etcd.port == 2379
