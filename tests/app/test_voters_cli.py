"""``metakv voters`` and the serve options of dynamic voters: bad input exits 2 with one
line before anything is sent, --standalone and --bootstrap-servers stand in for --voters."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.cli import main
from app.config import ConfigError, HostPort, build_node_config

BASE = {"node_id": "1", "data_dir": "/tmp/x", "listen_http": "127.0.0.1:8001", "listen_raft": "127.0.0.1:9001"}


@pytest.mark.parametrize("argv", [
    ["voters", "add", "x"], ["voters", "add", "-1"], ["voters", "remove", "1", "--directory-id", "ABC"],
    ["voters", "add", "2", "--raft-endpoint", "nohost"], ["voters", "add", "2", "--http-url", "ftp://h"],
    ["voters", "list", "--output", "value"], ["voters", "list", "--endpoints", "not-a-url"], ["voters"],
])
def test_bad_input_exits_2_with_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--endpoints", "http://127.0.0.1:1"] if argv[-1] in ("x", "-1") else argv) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "error" in error


def test_an_unreachable_cluster_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["voters", "list", "--endpoints", "http://127.0.0.1:1", "--timeout-ms", "300"]) == 1
    assert capsys.readouterr().err.startswith("metakv: ")


def test_standalone_is_the_only_voter_and_excludes_the_other_ways() -> None:
    config = build_node_config({**BASE, "standalone": True}, environ={})
    assert config.standalone and config.voters == {1: HostPort("127.0.0.1", 9001)}
    for extra, flag in (({"voters": "1@127.0.0.1:9001"}, "--standalone"), ({"observer": True}, "--standalone"),
                        ({"bootstrap_servers": "http://127.0.0.1:8002"}, "--bootstrap-servers")):
        with pytest.raises(ConfigError, match=flag):
            build_node_config({**BASE, "standalone": True, **extra}, environ={})
    with pytest.raises(ConfigError, match="needs a port"):
        build_node_config({**BASE, "listen_raft": "127.0.0.1:0", "standalone": True}, environ={})


def test_bootstrap_servers_start_an_observer_and_are_checked() -> None:
    config = build_node_config({**BASE, "bootstrap_servers": "http://127.0.0.1:8002, http://127.0.0.1:8003"},
                               environ={})
    assert config.observer and config.bootstrap_servers == ("http://127.0.0.1:8002", "http://127.0.0.1:8003")
    with pytest.raises(ConfigError, match="--bootstrap-servers"):
        build_node_config({**BASE, "bootstrap_servers": "127.0.0.1:8002"}, environ={})
    with pytest.raises(ConfigError, match="--voters"):  # none of the three: --voters is required
        build_node_config(BASE, environ={})


def test_serve_with_bootstrap_servers_nobody_answers_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["serve", "--node-id", "2", "--data-dir", str(tmp_path), "--listen-http", "127.0.0.1:8002",
            "--listen-raft", "127.0.0.1:9002", "--bootstrap-servers", "http://127.0.0.1:1"]
    assert main(argv) == 1
    assert "no server told the voters" in capsys.readouterr().err
