"""Voter changes through real nodes (app/runtime_voters.py, NodeRuntime.add_voter /
remove_voter): a standalone node grows to three voters, then removes itself, and the two
others elect a leader that commits; the gates answer with their codes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from app.config import HostPort, NodeConfig
from app.runtime import NodeRuntime
from app.runtime_voters import raft_endpoint
from app.service import NewVoter, NotLeaderError, VoterChangeRefusedError
from raft.node import Role
from storage.commands import Command, Op, OpKind
from tests.cluster import free_ports


def _config(data_dir: Path, node_id: int, leader_raft: HostPort | None, ports: tuple[int, int]) -> NodeConfig:
    http_port, raft_port = ports
    me = HostPort("127.0.0.1", raft_port)
    return NodeConfig(
        node_id=node_id, data_dir=data_dir, listen_http=HostPort("127.0.0.1", http_port), listen_raft=me,
        voters={1: leader_raft or me}, observer=leader_raft is not None, standalone=leader_raft is None,
        advertise_http=f"http://127.0.0.1:{http_port}", allowed_observers=frozenset({1, 2, 3}),
        cleaner_interval_ms=0, election_timeout_ms=300, fetch_timeout_ms=600, election_backoff_max_ms=300,
        fetch_max_wait_ms=100, request_timeout_ms=600)


async def _until(predicate: Callable[[], bool], what: str, limit_s: float = 15.0) -> None:
    for _ in range(int(limit_s / 0.05)):  # bounded
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not reached within {limit_s} s: {what}")


async def _add_when_caught_up(leader: NodeRuntime, runtime: NodeRuntime) -> None:
    """What an operator does: ask, and ask again while the leader says it is not caught up."""
    voter = NewVoter(runtime.node_id, raft_endpoint=raft_endpoint(runtime.config))  # the rest from its Fetches
    for _ in range(100):  # bounded: an observer on loopback catches up within a few fetches
        try:
            added = await leader.add_voter(voter)
            assert {"node_id": runtime.node_id, "directory_id": runtime.directory_id, "http_url":
                    runtime.config.advertise_http, "raft_endpoint": raft_endpoint(runtime.config)} in added["voters"]
            return
        except VoterChangeRefusedError as exc:
            if exc.code != "not-caught-up":
                raise
        await asyncio.sleep(0.05)
    raise AssertionError(f"node {runtime.node_id} never caught up")


def _put(key: str) -> Command:
    return Command((), (Op(OpKind.PUT, key, b"v"),))


def test_a_standalone_node_grows_to_three_voters_and_hands_over_by_removing_itself(tmp_path: Path) -> None:
    async def scenario() -> None:
        ports = free_ports(6)
        first = NodeRuntime(_config(tmp_path / "n1", 1, None, (ports[0], ports[1])), seed=1)
        runtimes = [first]
        try:
            await first.start()
            await _until(lambda: first.node.role == Role.LEADER and first.node.high_watermark > 2, "node 1 leads")
            await first.propose(_put("a"))
            leader_raft = first.config.listen_raft
            for node_id in (2, 3):
                runtime = NodeRuntime(_config(tmp_path / f"n{node_id}", node_id, leader_raft,
                                              (ports[2 * node_id - 2], ports[2 * node_id - 1])), seed=node_id)
                runtimes.append(runtime)
                await runtime.start()
            second, third = runtimes[1], runtimes[2]
            assert not second.node.is_voter and second.directory_id != first.directory_id

            with pytest.raises(NotLeaderError):  # only the leader changes voters
                await second.add_voter(NewVoter(3, third.directory_id, raft_endpoint(third.config)))
            with pytest.raises(VoterChangeRefusedError) as refused:  # a replica that never fetched
                await first.add_voter(NewVoter(4, "0" * 32, "127.0.0.1:1"))
            assert refused.value.code == "not-caught-up"
            await _until(lambda: {"node_id": 2, "directory_id": second.directory_id} in [
                {"node_id": o["node_id"], "directory_id": o.get("directory_id")} for o in first.quorum()["observers"]],
                "/v1/quorum names node 2's directory")
            with pytest.raises(VoterChangeRefusedError) as refused:  # nobody named its raft address
                await first.add_voter(NewVoter(2))
            assert refused.value.code == "raft-endpoint-unknown"

            for runtime in (second, third):
                await _add_when_caught_up(first, runtime)
            await _until(lambda: all(r.node.voter_set.ids == {1, 2, 3} for r in runtimes), "every node sees 3 voters")
            assert second.node.is_voter and third.node.is_voter
            await first.propose(_put("b"))  # committed by a majority of the three

            await first.remove_voter(1)  # the leader removes itself, then resigns
            await _until(lambda: any(r.node.role == Role.LEADER for r in (second, third)), "a new leader")
            successor = next(r for r in (second, third) if r.node.role == Role.LEADER)
            await successor.propose(_put("c"))
            assert successor.node.voter_set.ids == {2, 3}
            await _until(lambda: first.node.role == Role.FOLLOWER and not first.node.is_voter, "node 1 observes")
        finally:
            for runtime in reversed(runtimes):
                await runtime.stop()

    asyncio.run(scenario())
