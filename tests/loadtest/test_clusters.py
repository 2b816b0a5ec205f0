"""A missing etcd is a clear error (so the etcd tests fail rather than skip)."""

from __future__ import annotations

import pytest

from loadtest import clusters
from loadtest.local_cluster import free_ports


def test_missing_etcd_binary_is_an_error_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(clusters.shutil, "which", lambda name: None)
    with pytest.raises(clusters.ClusterError, match="make system"):
        clusters.start_etcd()


def test_free_ports_are_distinct() -> None:
    ports = free_ports(6)
    assert len(set(ports)) == 6 and all(port > 0 for port in ports)
