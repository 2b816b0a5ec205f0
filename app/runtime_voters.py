"""Voter changes on a running node (KIP-853; raft/roles.py rule 13): the runtime's side.

A node started with ``NodeConfig.standalone`` formats an empty log with itself as the only
voter (the first voters record, at offset 1). Others join as observers that name a voter in
``--voters`` (``--observer``), and the leader adds them one at a time (``POST
/v1/admin/voters``), answering once the voters record is committed. Every voters record
names each voter's raft endpoint (``host:port``); the runtime dials the ones it did not know
from its configuration. What the leader fills in for a request's missing fields, the views
/v1/status and /v1/quorum show, and the core's refusals as the service's errors are here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.config import ConfigError, parse_host_port
from app.service import (
    NewVoter,
    PendingVoterChange,
    ReplicaView,
    VoterChangeRefusedError,
    VoterSetView,
)
from raft.messages import ReplicaState
from raft.voters import Voter, VoterChangeError, VoterSet, is_directory_id
from storage.data_dir import DataDirError

if TYPE_CHECKING:
    from app.config import NodeConfig
    from app.transport import RaftTransport
    from raft.node import RaftNode


def raft_endpoint(config: NodeConfig) -> str:
    """This node's raft address as voters records name it."""
    return f"{config.listen_raft.url_host}:{config.listen_raft.port}"


def initial_voters_for(config: NodeConfig, directory_id: str) -> VoterSet | None:
    """``standalone``: this node alone, with its directory id; else None (static voters)."""
    if not config.standalone:
        return None
    return VoterSet((Voter(config.node_id, directory_id, raft_endpoint(config), config.advertise_http),))


def refuse_standalone_on_static_log(config: NodeConfig, voters: VoterSet) -> None:
    """--standalone formats an empty log; a log written without voters records (a --voters
    cluster's) is refused rather than silently run on its static set."""
    if config.standalone and kraft_version(voters) == 0:
        raise DataDirError(
            f"{config.data_dir}: --standalone formats an empty data directory, but this log was written by a "
            "--voters cluster (no voters record); start it with its --voters, or use a new --data-dir")


def learn_voter_addresses(transport: RaftTransport, voters: VoterSet, known: dict[int, str]) -> None:
    """Dial every voter of the set in force, also those added after this node started; note
    each raft endpoint in ``known`` (a removed voter added back needs it again)."""
    for voter in voters.voters:
        host, _, port = voter.endpoint.rpartition(":")
        if host and port.isdecimal():
            known[voter.replica_id] = voter.endpoint
            transport.add_peer(voter.replica_id, host.removeprefix("[").removesuffix("]"), int(port))


def kraft_version(voters: VoterSet) -> int:
    """0: a static --voters set (no directory ids, no changes); 1: a set from voters records."""
    return 1 if any(voter.directory_id for voter in voters.voters) else 0


def voter_set_view(node: RaftNode) -> VoterSetView:
    """The set in force in ``node``'s log and its uncommitted change, if any."""
    voters = node.voter_set
    pending: PendingVoterChange | None = None
    offset = node.pending_voter_change
    if offset is not None:
        before = node.voter_set_at(offset).ids
        added, removed = voters.ids - before, before - voters.ids
        if added or removed:
            pending = {"offset": offset, "action": "add" if added else "remove", "node_id": min(added or removed)}
    return {
        "kraft_version": kraft_version(voters),
        "voters": [{"node_id": v.replica_id, "directory_id": v.directory_id, "raft_endpoint": v.endpoint,
                    "http_url": v.http_url} for v in voters.voters],
        "pending_change": pending,
    }


def caught_up(replica: ReplicaState, high_watermark: int, now_ms: int, fetch_timeout_ms: int) -> bool:
    """The leader's gate for adding an observer (raft/leader.py, not-caught-up): it fetched
    within fetch_timeout_ms, at the high watermark or caught up within that time."""
    recent = 0 <= replica.last_fetch_timestamp_ms and now_ms - replica.last_fetch_timestamp_ms < fetch_timeout_ms
    return recent and (replica.log_end_offset >= high_watermark or (
        replica.last_caught_up_timestamp_ms >= 0 and now_ms - replica.last_caught_up_timestamp_ms < fetch_timeout_ms))


def add_voter_fields(view: ReplicaView, replica: ReplicaState, observer: bool, high_watermark: int, now_ms: int,
                     fetch_timeout_ms: int) -> ReplicaView:
    """A /v1/quorum row with its directory id, and for an observer whether it could be added."""
    view["directory_id"] = replica.directory_id
    if observer:
        view["caught_up"] = bool(replica.directory_id) and caught_up(replica, high_watermark, now_ms, fetch_timeout_ms)
    return view


def resolve_voter(request: NewVoter, voters: VoterSet, observers: tuple[ReplicaState, ...],
                  known_endpoints: dict[int, str]) -> Voter:
    """The voter a request names, its missing fields from what the leader knows: the
    directory id and HTTP URL of the observer's Fetches, a raft endpoint some voters record or
    --voters named. Refusals raise ``VoterChangeRefusedError``; those the core would give
    first (a static set, a voter already) are given here before a missing field's."""
    if kraft_version(voters) == 0:
        raise VoterChangeRefusedError("kraft-version-0", "the voter set is static (--voters): a cluster formatted "
                                      "with --standalone can change its voters")
    if request.node_id in voters.ids:
        raise VoterChangeRefusedError("already-voter", f"replica {request.node_id} is a voter already")
    fetched = next((replica for replica in observers if replica.replica_id == request.node_id), None)
    directory_id = request.directory_id or (fetched.directory_id if fetched is not None else "")
    if not directory_id:
        raise VoterChangeRefusedError(
            "not-caught-up", f"node {request.node_id} is not an observer fetching from this leader "
            "(start it with --observer naming a voter, and allow it with --allowed-observers)")
    if not is_directory_id(directory_id):
        raise VoterChangeRefusedError("bad-voter", f"directory_id {directory_id!r} is not 32 lowercase hex digits")
    endpoint = request.raft_endpoint or known_endpoints.get(request.node_id, "")
    if not endpoint:
        raise VoterChangeRefusedError(
            "raft-endpoint-unknown", f"no raft endpoint is known for node {request.node_id}: pass raft_endpoint "
            "(its --listen-raft as the voters reach it; `metakv voters add` reads it from the node's /v1/status)")
    try:
        address = parse_host_port("raft_endpoint", endpoint, min_port=1)
    except ConfigError as exc:
        raise VoterChangeRefusedError("bad-voter", str(exc)) from None
    http_url = request.http_url or (fetched.endpoint if fetched is not None else "")
    return Voter(request.node_id, directory_id, str(address), http_url)


def refused(exc: VoterChangeError) -> VoterChangeRefusedError:
    """The core's refusal as the service's error (the caller handles not-leader first)."""
    return VoterChangeRefusedError(exc.code, str(exc))
