"""`metakv cluster up` as a supervisor: a node failing to start fails the command (exit 1);
once the cluster is up, a node that exits is reported and the others keep running."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from app.cli import _supervise
from tests.app.test_cli import _port_ranges
from tests.cluster import REPO_ROOT


class _FakeChild:
    """A child process as _supervise sees it: poll() is None until it exits."""

    def __init__(self) -> None:
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


def test_a_node_that_exits_after_startup_is_reported_and_the_others_keep_running(
        capsys: pytest.CaptureFixture[str]) -> None:
    children = [(node_id, f"http://n{node_id}", _FakeChild()) for node_id in (1, 2, 3)]
    polls = 0

    def stop_requested() -> bool:
        nonlocal polls
        polls += 1
        if polls == 2:
            children[1][2].returncode = 0  # the user SIGTERMs node 2 to try a failover
        return polls > 6  # then, a few polls later, Ctrl-C

    assert _supervise(children, stop_requested, poll_interval_s=0) == 0
    assert polls == 7, "cluster up stopped before the user asked it to"
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["node 2 exited with code 0; 2 of 3 nodes still running (Ctrl-C stops the cluster)"]


def test_cluster_up_stops_once_every_node_has_exited(capsys: pytest.CaptureFixture[str]) -> None:
    children = [(node_id, f"http://n{node_id}", _FakeChild()) for node_id in (1, 2)]
    children[0][2].returncode = -9
    children[1][2].returncode = 1
    assert _supervise(children, lambda: False, poll_interval_s=0) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == "every node has exited; cluster up stops"
    assert "node 1 exited with code -9;" in lines[0] and "node 2 exited with code 1;" in lines[1]


def test_cluster_up_exits_1_when_a_node_cannot_start(tmp_path: Path) -> None:
    """Node 2's HTTP port is taken: it exits at startup, cluster up stops node 1 and exits 1
    (it printed "node 2 exited with code 3" and exited 0)."""
    http_base, raft_base = _port_ranges(2)
    holder = socket.socket()
    holder.bind(("127.0.0.1", http_base + 1))
    holder.listen()
    env = {key: value for key, value in os.environ.items() if not key.startswith("METAKV_")}
    env["METAKV_CLUSTER_ID"] = f"cli-fail-{uuid.uuid4().hex[:12]}"
    process = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "cluster", "up", "--voters", "2", "--observers", "0",
         "--base-http-port", str(http_base), "--base-raft-port", str(raft_base), "--data-dir", str(tmp_path),
         "--base-etcd-port", "0", "--base-etcd-gateway-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT, env=env,
        start_new_session=True)
    try:
        output, _ = process.communicate(timeout=90)
    finally:
        holder.close()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 1, output
    assert (f"metakv: cannot start node 2: --listen-http 127.0.0.1:{http_base + 1}: Address already in use"
            in output.splitlines()), output
    assert "node 2 exited with code 1 while the cluster was starting; stopping the cluster" in output
    with pytest.raises(httpx.TransportError):  # node 1 was stopped with the rest
        httpx.get(f"http://127.0.0.1:{http_base}/healthz", timeout=1)
