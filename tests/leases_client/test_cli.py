"""`metakv lock` as a user runs it, against a real 3-voter cluster, and the coordination
commands' bad input (long_cli.py, run by ``make chaos-locks``: a lost lease, SIGTERM, elect)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pytest

from app.cli import main
from metakv import Client
from tests.cluster import REPO_ROOT, Cluster
from tests.leases_client.fencing import FAST

WAIT_S = 60.0
HOLDERS = 3


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
        raise AssertionError(f"{process.args[3:]} still running; stdout {out!r}, stderr {err!r}") from None
    return process.returncode, out, err


def read_json_line(stream: IO[str] | None) -> dict[str, Any]:
    assert stream is not None
    line = stream.readline()
    assert line, "the command ended without printing"
    document: dict[str, Any] = json.loads(line)
    return document


def test_lock_runs_the_command_one_holder_at_a_time_and_passes_its_exit_code(
        cluster_factory: Callable[..., Cluster], tmp_path: Path) -> None:
    """Holders run `metakv lock` (its main(), in threads: a process each would cost this test
    most of its time in imports) against a single voter: failover is the long tests' part."""
    cluster = cluster_factory(voters=1, settings=FAST)
    cluster.wait_for_leader()
    journal = tmp_path / "journal"
    script = f'echo "start $METAKV_LOCK_VERSION" >> {journal}; sleep 0.3; echo end >> {journal}; exit 7'
    argv = ["lock", "job", "--ttl", "5", "--endpoints", cluster.voters[0].url, "--", "sh", "-c", script]
    codes: list[int] = []
    holders = [threading.Thread(target=lambda: codes.append(main(argv))) for _ in range(HOLDERS)]
    for holder in holders:
        holder.start()
    for holder in holders:
        holder.join(WAIT_S)
    assert codes == [7] * HOLDERS
    lines = journal.read_text().split("\n")[:-1]
    assert [line.split()[0] for line in lines] == ["start", "end"] * HOLDERS  # never two inside at once
    tokens = [int(line.split()[1]) for line in lines if line.startswith("start")]
    assert tokens == sorted(tokens) and len(set(tokens)) == HOLDERS and tokens[0] > 0  # fencing tokens grow
    with Client(cluster.voters[0].url) as kv:
        assert kv.list("locks/job/").items == [] and kv.leases() == []  # released, leases revoked


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
