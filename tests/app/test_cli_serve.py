"""`metakv serve` that cannot listen on its HTTP address: one line and exit 1, before the raft
side starts. main() runs in-process: the node never gets far enough to need a process."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.cli import main
from tests.cluster import free_ports


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for key in [key for key in os.environ if key.startswith("METAKV_")]:
        monkeypatch.delenv(key)
    monkeypatch.setattr(sys, "setswitchinterval", lambda interval: None)  # serve() tunes the process
    yield


def serve(tmp_path: Path, listen_http: str, raft_port: int) -> list[str]:
    return ["serve", "--node-id", "1", "--data-dir", str(tmp_path / "data"), "--listen-http", listen_http,
            "--listen-raft", f"127.0.0.1:{raft_port}", "--voters", f"1@127.0.0.1:{raft_port}"]


def test_a_taken_http_port_stops_the_node_with_one_line_before_raft_starts(
        tmp_path: Path, clean_env: None, capsys: pytest.CaptureFixture[str]) -> None:
    http_port, raft_port = free_ports(2)
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", http_port))
        holder.listen()
        assert main(serve(tmp_path, f"127.0.0.1:{http_port}", raft_port)) == 1
    finally:
        holder.close()
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"metakv: cannot start node 1: --listen-http 127.0.0.1:{http_port}: Address already in use"]
    assert not (tmp_path / "data").exists()  # the node did not start: no log, no quorum state


def test_an_unresolvable_http_host_stops_the_node_with_one_line(
        tmp_path: Path, clean_env: None, capsys: pytest.CaptureFixture[str]) -> None:
    raft_port = free_ports(1)[0]
    assert main(serve(tmp_path, "no-such-host.invalid:19011", raft_port)) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("metakv: cannot start node 1: --listen-http no-such-host.invalid:19011: "
                               "cannot resolve 'no-such-host.invalid'")
    assert not (tmp_path / "data").exists()


def test_listen_http_equal_to_listen_raft_is_refused(
        tmp_path: Path, clean_env: None, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_ports(1)[0]
    for http_host in ("127.0.0.1", "0.0.0.0"):
        assert main(serve(tmp_path, f"{http_host}:{port}", port)) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines == [f"metakv: error: --listen-http: {http_host}:{port} is also --listen-raft 127.0.0.1:{port}; "
                         "HTTP and raft need different ports"]
    assert not (tmp_path / "data").exists()
