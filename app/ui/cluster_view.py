"""The dashboard's cluster view: one snapshot of every node, its leader taken from the raft
state (never guessed), shared by every open tab.

A node knows its own status (the service interface) and, when it leads, the quorum. For the
rest it asks the other nodes' public HTTP API: the leader's /v1/quorum for every replica's
log end, lag and caught-up time, each node's /v1/status for its role, applied version,
snapshot and cleaner progress. Those routes need any valid token, so the caller's
Authorization header goes along (every node reads the same token file). One snapshot serves
every request for ``SNAPSHOT_TTL_S``: twenty tabs cost this node what one does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import httpx
import orjson

from app.service import KVService, NodeStatus, NotLeaderError, QuorumView

SNAPSHOT_TTL_S = 0.8  # tabs poll every second; one gathering serves all of them
PEER_TIMEOUT_S = 1.0  # a node slower than this to answer /v1/status is shown as down
# A replica that has not been caught up with the leader for this long is not counted as
# healthy when saying how many voters the cluster can lose.
CAUGHT_UP_RECENT_MS = 5000
# What the view reads from another node's answer: one without these (another program on a
# reused port, another version) counts as no answer, never as a 500 for every tab.
STATUS_FIELDS = ("node_id", "role", "epoch", "leader_id", "voter")
QUORUM_FIELDS = ("epoch", "leader_id", "high_watermark", "voters", "observers")
REPLICA_FIELDS = ("node_id", "endpoint")


class ClusterView:
    """Gathers and caches the snapshot ``/ui/api/cluster`` answers."""

    def __init__(self, service: KVService) -> None:
        self.service = service
        self._snapshot: bytes | None = None  # encoded once, answered to every tab as is
        self._taken_s = 0.0
        self._gathering: asyncio.Future[bytes] | None = None
        # Every node URL a quorum view named: a new leader lists an observer only once it
        # fetched, and without a leader there is no quorum view at all.
        self._endpoints: dict[int, str] = {}

    async def snapshot(self, authorization: str | None) -> bytes:
        """The current snapshot as JSON: cached, or gathered once for every caller waiting on it."""
        if self._snapshot is not None and time.monotonic() - self._taken_s < SNAPSHOT_TTL_S:
            return self._snapshot
        if self._gathering is None:
            self._gathering = asyncio.ensure_future(self._gather(authorization))
            self._gathering.add_done_callback(self._gathered)
        return await asyncio.shield(self._gathering)

    def _gathered(self, done: asyncio.Future[bytes]) -> None:
        self._gathering = None
        if not done.cancelled() and done.exception() is None:
            self._snapshot = done.result()
            self._taken_s = time.monotonic()

    async def _gather(self, authorization: str | None) -> bytes:
        headers = {"Authorization": authorization} if authorization else {}
        local = self.service.status()
        async with httpx.AsyncClient(timeout=PEER_TIMEOUT_S, headers=headers) as client:
            quorum = await self._quorum(client, local)
            if quorum is not None:
                self._endpoints.update({replica["node_id"]: replica["endpoint"]
                                        for replica in [*quorum["voters"], *quorum["observers"]] if replica["endpoint"]})
            others = {node_id: url for node_id, url in self._endpoints.items() if node_id != local["node_id"]}
            answers = await asyncio.gather(*(_fetch_status(client, f"{url}/v1/status") for url in others.values()))
            statuses: dict[int, NodeStatus | None] = {local["node_id"]: local}
            statuses.update({node_id: answer for node_id, answer in zip(others, answers, strict=True)})  # type: ignore[misc]
            leader_id, epoch = leader_of(statuses)
            if quorum is not None and (quorum["leader_id"], quorum["epoch"]) != (leader_id, epoch):
                # The quorum came from a leader another node already knows to be replaced.
                newer = statuses.get(leader_id)
                quorum = await _fetch_quorum(client, f"{newer['advertise_http']}/v1/quorum") if newer and newer.get(
                    "advertise_http") else None
        return orjson.dumps(describe(local["node_id"], statuses, quorum, leader_id, epoch, int(time.time() * 1000)))

    async def _quorum(self, client: httpx.AsyncClient, local: NodeStatus) -> QuorumView | None:
        if local["role"] == "leader":
            try:
                return self.service.quorum()
            except NotLeaderError:
                return None  # it stepped down between the two calls
        if local["leader_url"]:
            return await _fetch_quorum(client, f"{local['leader_url']}/v1/quorum")
        return None


async def _fetch_status(client: httpx.AsyncClient, url: str) -> NodeStatus | None:
    answer = await _fetch_json(client, url)
    return answer if _has_fields(answer, STATUS_FIELDS) else None


async def _fetch_quorum(client: httpx.AsyncClient, url: str) -> QuorumView | None:
    answer = await _fetch_json(client, url)
    if not _has_fields(answer, QUORUM_FIELDS) or not all(
            isinstance(members, list) and all(_has_fields(replica, REPLICA_FIELDS) for replica in members)
            for members in (answer["voters"], answer["observers"])):
        return None
    return answer  # type: ignore[no-any-return]


def _has_fields(answer: Any, fields: tuple[str, ...]) -> bool:
    return isinstance(answer, dict) and all(field in answer for field in fields)


async def _fetch_json(client: httpx.AsyncClient, url: str) -> Any:
    """The JSON answer of a 200, else None (down, slow, redirected, refused)."""
    try:
        response = await client.get(url)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return response.json()
    except ValueError:
        return None


def leader_of(statuses: Mapping[int, NodeStatus | None]) -> tuple[int, int]:
    """(leader id, epoch) from the raft state the nodes report: the leader known at the
    highest epoch. An epoch has at most one leader, so this never names two. When no
    answering node knows a leader: -1 and the highest epoch reported (an election under way
    is a newer picture than the last leader's, and the page must not ignore it as older)."""
    best = (-1, -1)
    for status in statuses.values():
        if status is not None and status["leader_id"] >= 0 and status["epoch"] > best[1]:
            best = (status["leader_id"], status["epoch"])
    if best[0] < 0:
        best = (-1, max((status["epoch"] for status in statuses.values() if status is not None), default=-1))
    return best


def describe(self_id: int, statuses: Mapping[int, NodeStatus | None], quorum: QuorumView | None,
             leader_id: int, epoch: int, now_ms: int) -> dict[str, Any]:
    """The snapshot's JSON: one row per node, the leader once, and the fault tolerance."""
    replicas: dict[int, dict[str, Any]] = {}
    if quorum is not None:
        for kind, members in (("voter", quorum["voters"]), ("observer", quorum["observers"])):
            for replica in members:
                replicas[replica["node_id"]] = {**replica, "kind": kind}
    nodes = []
    for node_id in sorted(set(statuses) | set(replicas)):
        status = statuses.get(node_id)
        replica = replicas.get(node_id, {})
        kind = replica.get("kind") or ("voter" if status and status["voter"] else "observer")
        nodes.append({
            "node_id": node_id,
            "kind": kind,
            "up": status is not None,
            "role": shown_role(node_id, status, leader_id, epoch),
            "url": replica.get("endpoint") or (status or {}).get("advertise_http"),
            "log_end_offset": replica.get("log_end_offset", (status or {}).get("log_end_offset")),
            "lag": replica.get("lag"),
            "last_caught_up_timestamp_ms": replica.get("last_caught_up_timestamp_ms"),
            "last_fetch_timestamp_ms": replica.get("last_fetch_timestamp_ms"),
            **{field: (status or {}).get(field) for field in (
                "epoch", "applied_version", "high_watermark", "dirty_offset", "cleaned_end", "snapshot_id",
                "log_size_bytes", "oldest_version", "ready")},
        })
    voters = [node for node in nodes if node["kind"] == "voter"]
    majority = len(voters) // 2 + 1
    healthy = [node for node in voters if node["up"] and (
        node["node_id"] == leader_id or _recently_caught_up(node["last_caught_up_timestamp_ms"], now_ms))]
    return {
        "node_id": self_id,
        "leader_id": leader_id,
        "epoch": epoch,
        "high_watermark": quorum["high_watermark"] if quorum is not None else None,
        "quorum_known": quorum is not None,
        # Unknown without the leader's quorum view: who is caught up is the leader's to say,
        # and which voters exist too (a node whose dashboard never saw a leader knows only itself).
        "voters": None if quorum is None else len(voters),
        "majority": None if quorum is None else majority,
        "healthy_voters": None if quorum is None else len(healthy),
        "can_lose": None if quorum is None else max(0, len(healthy) - majority),
        "nodes": nodes,
        "taken_ms": now_ms,
    }


def shown_role(node_id: int, status: NodeStatus | None, leader_id: int, epoch: int) -> str:
    """The role the view shows: "leader" only for the leader of the highest epoch known; a
    node still calling itself leader of an older epoch is shown as such."""
    if status is None:
        return "down"
    if node_id == leader_id:
        return "leader"
    if status["role"] == "leader":
        return f"deposed (epoch {status['epoch']} < {epoch})"
    return status["role"]


def _recently_caught_up(timestamp_ms: int | None, now_ms: int) -> bool:
    return timestamp_ms is not None and now_ms - timestamp_ms <= CAUGHT_UP_RECENT_MS
