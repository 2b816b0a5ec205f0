"""`metakv lock` and `metakv elect` as a user runs them, against a real 3-voter cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pytest

from app.cli import main
from metakv import Client
from tests.cluster import REPO_ROOT, Cluster
from tests.leases_client.fencing import FAST

WAIT_S = 60.0


def cli(cluster: Cluster, *args: str, **popen: Any) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1",
           "METAKV_ENDPOINTS": ",".join(node.url for node in cluster.voters)}
    return subprocess.Popen([sys.executable, "-m", "app.cli", *args], cwd=REPO_ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def finished(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise AssertionError(f"still running: {out} {err}") from None
    return process.returncode, out, err


def read_json_line(stream: IO[str] | None) -> dict[str, Any]:
    assert stream is not None
    line = stream.readline()
    assert line, "the command ended without printing"
    document: dict[str, Any] = json.loads(line)
    return document


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_lock_runs_the_command_one_holder_at_a_time_and_passes_its_exit_code(
        cluster_factory: Callable[..., Cluster], tmp_path: Path) -> None:
    cluster = cluster_factory(voters=3, settings=FAST)
    cluster.wait_for_leader()
    journal = tmp_path / "journal"
    script = f'echo "start $METAKV_LOCK_VERSION" >> {journal}; sleep 0.4; echo end >> {journal}; exit 7'
    holders = [cli(cluster, "lock", "job", "--ttl", "5", "--", "sh", "-c", script) for _ in range(3)]
    for holder in holders:
        code, _, err = finished(holder)
        assert code == 7, err
    lines = journal.read_text().split("\n")[:-1]
    assert [line.split()[0] for line in lines] == ["start", "end"] * 3  # never two inside at once
    tokens = [int(line.split()[1]) for line in lines if line.startswith("start")]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3 and tokens[0] > 0  # fencing tokens grow
    with Client([node.url for node in cluster.voters]) as kv:
        assert kv.list("locks/job/").items == []  # released


def test_lock_stops_the_command_when_its_lease_is_lost_and_releases_on_sigterm(
        cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(voters=3, settings=FAST)
    cluster.wait_for_leader()
    with Client([node.url for node in cluster.voters]) as kv:
        lost = cli(cluster, "lock", "lost", "--ttl", "3", "--", "sh", "-c", "echo running; exec sleep 60")
        assert lost.stdout is not None and lost.stdout.readline() == "running\n"
        held = kv.list("locks/lost/").items
        assert len(held) == 1 and held[0].lease > 0
        kv.revoke(held[0].lease)  # from outside: the holder must notice and stop its command
        code, _, err = finished(lost)
        assert code == 1 and "lock lost" in err

        stopped = cli(cluster, "lock", "term", "--", "sh", "-c", "echo running; exec sleep 60")
        assert stopped.stdout is not None and stopped.stdout.readline() == "running\n"
        stopped.send_signal(signal.SIGTERM)
        code, _, _ = finished(stopped)
        assert code == 128 + signal.SIGTERM
        assert kv.list("locks/term/").items == []


def test_elect_prints_the_leader_and_a_listener_sees_each_one(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(voters=3, settings=FAST)
    cluster.wait_for_leader()
    first = cli(cluster, "elect", "svc", "one", "--ttl", "3")
    assert read_json_line(first.stdout)["value"] == "one"
    second = cli(cluster, "elect", "svc", "two", "--ttl", "3")
    listener = cli(cluster, "elect", "svc", "--listen")
    try:
        assert read_json_line(listener.stdout)["value"] == "one"
        first.send_signal(signal.SIGINT)  # resigns
        assert finished(first)[0] == 0
        assert read_json_line(second.stdout)["value"] == "two"
        assert read_json_line(listener.stdout)["value"] == "two"
    finally:
        for process in (first, second, listener):
            if process.poll() is None:
                process.kill()
                process.communicate()


@pytest.mark.parametrize(("args", "expected"), [
    (["lock", "job"], "lock: give the command to run after --"),
    (["lock", "job", "--ttl", "0", "--", "true"], "--ttl: 0 is outside [1, 86400]"),
    (["lock", "", "--", "true"], "KEY: must be non-empty"),
    (["elect", "svc"], "elect: give a VALUE to campaign with, or --listen"),
    (["elect", "svc", "v", "--listen"], "elect: --listen takes no VALUE"),
    (["lease", "grant", "x"], "TTL: expected an integer"),
    (["lease", "revoke", "0"], "ID: 0 is outside"),
    (["lease", "ttl", "-5"], "ID: -5 is outside"),
])
def test_bad_input_exits_2_with_one_line_before_asking_the_cluster(
        args: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main([*args[:1], *args[1:], "--endpoints", "http://127.0.0.1:9"] if "--" not in args
                else [*args[:args.index("--")], "--endpoints", "http://127.0.0.1:9", *args[args.index("--"):]])
    captured = capsys.readouterr()
    assert code == 2 and captured.err.count("\n") == 1 and expected in captured.err, captured.err
