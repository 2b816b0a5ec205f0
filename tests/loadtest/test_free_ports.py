"""free_ports never hands out a port twice in a row, though the first taker has not bound it."""

from __future__ import annotations

import pytest

from loadtest import local_cluster


def test_ports_handed_out_are_not_handed_out_again_before_they_are_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    # A range of 100 ports: two draws of 60 must overlap unless the first draw is remembered.
    monkeypatch.setattr(local_cluster, "_ephemeral_low", lambda: local_cluster.LISTEN_PORTS_LOW + 100)
    monkeypatch.setattr(local_cluster, "_HANDED_OUT", {})
    first = local_cluster.free_ports(60)
    second = local_cluster.free_ports(60)
    assert len(set(first)) == len(set(second)) == 60
    assert set(first).isdisjoint(second)
