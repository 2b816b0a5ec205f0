"""A corrupt log stops startup with one line naming the file and byte offset; `metakv repair`
discards the log from the offset it names, and the node re-fetches and serves again."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable

from tests.cluster import REPO_ROOT, Cluster


def test_corrupt_log_stops_startup_and_repair_lets_the_node_catch_up(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(voters=3)
    leader = cluster.wait_for_leader()
    version = 0
    for i in range(40):
        version = cluster.put(f"repair/k{i:02d}", str(i).encode(), node=leader).json()["version"]
    victim = next(node for node in cluster.voters if node.node_id != leader.node_id)
    cluster.client().get(f"{victim.url}/v1/kv/repair/k00", params={"min_version": version})
    assert victim.stop() == 0
    segment = sorted((victim.data_dir / "log").glob("*.log"))[0]
    data = bytearray(segment.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped bit in the middle: not a torn tail
    segment.write_bytes(bytes(data))

    started = subprocess.run(victim.command, env=victim.env, cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=60)
    assert started.returncode == 1
    error_lines = [line for line in started.stderr.splitlines() if line.startswith("metakv:")]
    assert len(error_lines) == 1, started.stderr
    assert str(segment) in error_lines[0] and "at byte" in error_lines[0]
    truncate_at = re.search(r"--truncate-at (\d+)", error_lines[0])
    assert truncate_at is not None, error_lines[0]

    repaired = subprocess.run(
        [sys.executable, "-m", "app.cli", "repair", "--data-dir", str(victim.data_dir),
         "--truncate-at", truncate_at.group(1)], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert repaired.returncode == 0, repaired.stderr
    verified = subprocess.run([sys.executable, "-m", "app.cli", "repair", "--data-dir", str(victim.data_dir),
                               "--verify"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert verified.returncode == 0 and verified.stdout.startswith("ok:"), verified.stderr

    victim.start()
    cluster.wait_ready(victim)
    for i in range(40):
        read = cluster.client().get(f"{victim.url}/v1/kv/repair/k{i:02d}", params={"min_version": version})
        assert read.status_code == 200 and read.content == str(i).encode()
    status = cluster.status(victim)
    assert status is not None and status["log_end_offset"] >= version
