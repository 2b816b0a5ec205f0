"""A voter whose log was lost (raft/roles.py rule 12) as the runtime starts it: it says so,
persists it, and a lone voter, whom nobody can send the records again, refuses to start."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from app.config import HostPort, NodeConfig
from app.runtime import NodeRuntime
from storage.data_dir import DataDirError
from tests.cluster import free_ports


def _voter_config(data_dir: Path, peers: int) -> NodeConfig:
    ports = free_ports(2 + peers)
    voters = {node_id: HostPort("127.0.0.1", ports[node_id]) for node_id in range(1, 2 + peers)}
    return NodeConfig(node_id=1, data_dir=data_dir, listen_http=HostPort("127.0.0.1", ports[0]),
                      listen_raft=voters[1], voters=voters, advertise_http=f"http://127.0.0.1:{ports[0]}",
                      cleaner_interval_ms=0)


def _lost_log(data_dir: Path) -> None:
    """What the way out of a damaged log leaves: quorum-state (and identity.json) only."""
    data_dir.mkdir()
    (data_dir / "quorum-state").write_text(json.dumps(
        {"epoch": 4, "voted_id": 1, "leader_id": 2, "log_acknowledged": True, "log_lost": False}))


def test_a_voter_whose_log_was_lost_says_so_and_persists_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _lost_log(tmp_path / "n1")

    async def scenario() -> None:
        runtime = NodeRuntime(_voter_config(tmp_path / "n1", peers=2), seed=1)
        await runtime.start()
        try:
            assert runtime.node.log_lost
        finally:
            await runtime.stop()

    with caplog.at_level(logging.WARNING):
        asyncio.run(scenario())
    assert "its log was lost" in caplog.text and "neither votes nor stands for election" in caplog.text
    assert json.loads((tmp_path / "n1" / "quorum-state").read_text())["log_lost"] is True


def test_a_lone_voter_whose_log_was_lost_refuses_to_start(tmp_path: Path) -> None:
    _lost_log(tmp_path / "n1")
    with pytest.raises(DataDirError, match="its log was lost, and as the only voter"):
        asyncio.run(NodeRuntime(_voter_config(tmp_path / "n1", peers=0), seed=1).start())
