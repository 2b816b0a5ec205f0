"""Hardening of a running node (issue 21): private data files, log lines, a storage quota."""

from __future__ import annotations

import stat
from collections.abc import Callable

from tests.cluster import Cluster

GROUP_OR_OTHER = stat.S_IRWXG | stat.S_IRWXO


def test_the_data_directory_and_every_file_in_it_are_the_owners_only(
        cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(voters=1)
    node = cluster.wait_for_leader()
    for index in range(20):
        assert cluster.put(f"private/{index}", b"secret").status_code == 200
    entries = [node.data_dir, *node.data_dir.rglob("*")]
    names = {path.name for path in entries}
    assert {"state.db", "state.db-wal", "quorum-state", "LOCK"} <= names, names
    assert any(path.suffix == ".log" for path in entries)
    assert stat.S_IMODE(node.data_dir.stat().st_mode) == 0o700
    exposed = {str(path.relative_to(node.data_dir)): oct(stat.S_IMODE(path.stat().st_mode))
               for path in entries if path.stat().st_mode & GROUP_OR_OTHER}
    assert exposed == {}
