"""Voter changes on a running node (KIP-853; raft/roles.py rule 13): the runtime's side.

A node started with ``NodeConfig.standalone`` formats an empty log with itself as the only
voter (the first voters record, at offset 1). Others join as observers that name it in
``--voters`` (``--observer``), and the leader adds them one at a time with ``add_voter``,
which answers once the voters record is committed. Every voters record names each voter's
raft endpoint (``host:port``); the runtime dials the ones it did not know from its
configuration. ``NodeRuntime.add_voter`` / ``remove_voter`` use these. (No HTTP or CLI
surface yet: docs/raft.md, Limits.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from raft.voters import Voter, VoterSet

if TYPE_CHECKING:
    from app.config import NodeConfig
    from app.transport import RaftTransport


class VoterChangeIndeterminateError(Exception):
    """The voters record was appended but not seen committed in time (or a new leader's
    log replaced it): the change may or may not take effect; look at the set and retry."""


def raft_endpoint(config: NodeConfig) -> str:
    """This node's raft address as voters records name it."""
    return f"{config.listen_raft.host}:{config.listen_raft.port}"


def initial_voters_for(config: NodeConfig, directory_id: str) -> VoterSet | None:
    """``standalone``: this node alone, with its directory id; else None (static voters)."""
    if not config.standalone:
        return None
    return VoterSet((Voter(config.node_id, directory_id, raft_endpoint(config), config.advertise_http),))


def learn_voter_addresses(transport: RaftTransport, voters: VoterSet) -> None:
    """Dial every voter of the set in force, also those added after this node started."""
    for voter in voters.voters:
        host, _, port = voter.endpoint.rpartition(":")
        if host and port.isdecimal():
            transport.add_peer(voter.replica_id, host, int(port))
