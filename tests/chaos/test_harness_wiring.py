"""The harness routes every raft link through its proxy (checked without starting nodes)."""

from __future__ import annotations

from pathlib import Path

from tests.chaos.harness import ChaosCluster


def test_each_node_dials_its_peers_through_its_own_outbound_proxies(tmp_path: Path) -> None:
    chaos = ChaosCluster(tmp_path, voters=3)
    try:
        nodes = chaos.cluster.nodes
        for node in nodes.values():
            spec = node.command[node.command.index("--voters") + 1]
            entries = dict(entry.split("@") for entry in spec.split(","))
            assert entries[str(node.node_id)] == f"127.0.0.1:{node.raft_port}"  # itself: real address
            for peer in nodes.values():
                if peer.node_id == node.node_id:
                    continue
                proxy = chaos.network.link(node.node_id, peer.node_id)
                assert entries[str(peer.node_id)] == f"127.0.0.1:{proxy.port}"
                assert (proxy.target_host, proxy.target_port) == ("127.0.0.1", peer.raft_port)
        assert len(chaos.network.links) == 6
    finally:
        chaos.close()
