"""etcd's v3 KV, Maintenance and Cluster calls mapped onto the service interface: the one
place etcd's rules live (the gRPC server and the JSON gateway both call it).

- etcd's revision is metakv's version; a key's create_revision, mod_revision and version
  are its create_version, mod_version and key_version; raft_term is the epoch.
- Keys are bytes in etcd and text in metakv: a key must be UTF-8. Ranges compare UTF-8
  bytes, which order as metakv's keys do (code points).
- Every write is one service txn. A call whose outcome depends on what it reads (Txn
  compares, DeleteRange and Range over a range inside a Txn, Put's ignore_value) reads
  first, decides, and writes with a guard: every key it read must still be at the
  mod_version it read, else it reads and decides again (optimistic concurrency), so the
  outcome is one etcd would give at the version the write applies at. A key created in a
  range between the read and the write is the exception (documented, docs/etcd.md).
- A nested Txn's compares are decided with the outer ones, on the same read (as etcd: every
  compare of the txn tree sees the state before the txn); its chosen ops join the one write.
- Leases are metakv's (docs/leases.md): a lease id is etcd's ID, the calls are the
  service's, forwarded to the leader from a follower like writes.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import grpc

from app.etcd.errors import (
    EMPTY_KEY,
    FUTURE_REVISION,
    KEY_NOT_FOUND,
    LEASE_NOT_FOUND,
    LEASE_PROVIDED,
    TOO_LARGE,
    EtcdError,
    compacted,
    etcd_error,
    from_service_error,
    invalid,
    unimplemented,
)
from app.etcd.leader_link import LeaderLink
from app.etcd.protos import kv_pb2, rpc_pb2
from app.http.settings import KEY_MAX_BYTES
from app.service import (
    DEFAULT_CONTENT_TYPE,
    MAX_LEASE_ID,
    Compare,
    CompareKind,
    Entry,
    KVService,
    Op,
    OpKind,
    OpResult,
    ServiceError,
)

# The etcd release whose v3 API this front end follows (etcdctl and clients read it from
# Maintenance.Status).
ETCD_API_VERSION = "3.4.0"
LIST_PAGE = 1000
GUARDED_ATTEMPTS = 16  # reads-then-guarded-writes before a busy key gives up (UNAVAILABLE)
MAX_TXN_OPS = 128  # etcd's default --max-txn-ops, and metakv's ops per txn branch
ALL_KEYS = b"\0"
# etcd's own answers (api/v3rpc/rpctypes) for a txn request it refuses before running it
TOO_MANY_OPS = (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: too many operations in txn request")
DUPLICATE_KEY = (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: duplicate key given in txn request")
VALUE_PROVIDED = (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: value is provided")
INVALID_SORT = (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: invalid sort option")


def cluster_number(cluster_id: str) -> int:
    """etcd's cluster_id (a uint64) for metakv's cluster id string: stable, from its hash."""
    return int.from_bytes(hashlib.blake2b(cluster_id.encode(), digest_size=8).digest(), "big")


def prefix_end(prefix: bytes) -> bytes:
    """etcd's range_end for every key starting with ``prefix`` (clientv3.GetPrefixRangeEnd)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return ALL_KEYS


@dataclass(frozen=True, slots=True)
class KeyRange:
    """[start, end) in UTF-8 bytes; ``end`` None: to the last key; ``single``: just ``start``."""

    start: bytes
    end: bytes | None
    single: bool

    @staticmethod
    def of(key: bytes, range_end: bytes) -> KeyRange:
        if not range_end:
            if not key:
                raise etcd_error(EMPTY_KEY)
            return KeyRange(key, None, True)
        if key == ALL_KEYS and range_end == ALL_KEYS:
            return KeyRange(b"", None, False)
        return KeyRange(key, None if range_end == ALL_KEYS else range_end, False)

    def holds(self, key: bytes) -> bool:
        if self.single:
            return key == self.start
        return key >= self.start and (self.end is None or key < self.end)

    def list_prefix(self) -> str:
        """The longest text prefix every key of the range has (listing under it and
        filtering by the bounds finds them all)."""
        if self.end is None:
            return ""
        common = bytearray()
        for low, high in zip(self.start, self.end, strict=False):
            if low != high:
                break
            common.append(low)
        while common:
            try:
                return bytes(common).decode("utf-8")
            except UnicodeDecodeError:
                common.pop()  # cut inside a character: shorter is still a prefix
        return ""


def text_key(key: bytes) -> str:
    """The metakv key for etcd's: the HTTP API's key rules hold on every member (a follower
    forwards through that API, so the leader must not take what a follower cannot pass on)."""
    if len(key) > KEY_MAX_BYTES:
        raise invalid(f"a key is at most {KEY_MAX_BYTES} bytes (this one is {len(key)})")
    if b"\0" in key:
        raise invalid("a key may not contain a zero byte")
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        raise invalid("keys must be UTF-8 (metakv keys are text)") from None


def lease_id(etcd_id: int) -> int:
    """metakv's lease for etcd's ID (an int64): ids outside 1..MAX_LEASE_ID name no lease."""
    if not 0 < etcd_id <= MAX_LEASE_ID:
        raise etcd_error(LEASE_NOT_FOUND)
    return etcd_id


def _text_or_none(key: bytes) -> str | None:
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return None


def key_value(entry: Entry, keys_only: bool = False) -> kv_pb2.KeyValue:
    return kv_pb2.KeyValue(key=entry.key.encode(), create_revision=entry.create_version,
                           mod_revision=entry.mod_version, version=entry.key_version,
                           value=b"" if keys_only else entry.value, lease=entry.lease)


# RangeRequest.SortTarget -> the entry's sort key
_SORT_KEYS: dict[int, Callable[[Entry], object]] = {
    rpc_pb2.RangeRequest.KEY: lambda entry: entry.key.encode(),
    rpc_pb2.RangeRequest.VERSION: lambda entry: entry.key_version,
    rpc_pb2.RangeRequest.CREATE: lambda entry: entry.create_version,
    rpc_pb2.RangeRequest.MOD: lambda entry: entry.mod_version,
    rpc_pb2.RangeRequest.VALUE: lambda entry: entry.value,
}


class EtcdMapping:
    """etcd's calls on one node's service. ``member_urls``: node id -> its etcd client URLs
    as far as this node knows them (for MemberList; the others' are learned on the way)."""

    def __init__(self, service: KVService, cluster_id: str, member_urls: dict[int, list[str]]) -> None:
        self.service = service
        self.cluster_id = cluster_number(cluster_id)
        self.member_urls = member_urls
        self.link = LeaderLink(service)

    async def close(self) -> None:
        await self.link.close()

    # ---- headers -------------------------------------------------------------------

    def header(self, revision: int | None = None) -> rpc_pb2.ResponseHeader:
        """etcd's header: revision is the version given (a write's), else this node's."""
        node = self.service.headers()
        return rpc_pb2.ResponseHeader(
            cluster_id=self.cluster_id, member_id=node.node_id,
            revision=node.metadata_version if revision is None else revision, raft_term=node.epoch)

    # ---- reads ---------------------------------------------------------------------

    def _read(self, keys: KeyRange, revision: int) -> tuple[int, list[Entry]]:
        """(version read at, the entries of ``keys`` at ``revision``: 0 for now), in key order."""
        at_version = revision if revision > 0 else None
        try:
            if at_version is not None and at_version > self.service.headers().metadata_version:
                raise etcd_error(FUTURE_REVISION)
            if keys.single:
                read = self.service.get(text_key(keys.start), at_version=at_version)
                return read.version, [] if read.entry is None else [read.entry]
            prefix = keys.list_prefix()
            found: list[Entry] = []
            after: str | None = None
            first = _text_or_none(keys.start)
            skip_to_first = first is not None and first > prefix
            if skip_to_first:
                after = first  # list from the range's first key, not the prefix's; it is read below
            while True:
                page = self.service.list(prefix, after=after, limit=LIST_PAGE, at_version=at_version)
                if skip_to_first:  # the first key itself, at the listing's version
                    skip_to_first = False
                    read = self.service.get(first, at_version=page.version)  # type: ignore[arg-type]
                    if read.entry is not None and keys.holds(keys.start):
                        found.append(read.entry)
                at_version = page.version
                for entry in page.entries:
                    encoded = entry.key.encode()
                    if keys.end is not None and encoded >= keys.end:
                        return at_version, found
                    if encoded >= keys.start:
                        found.append(entry)
                if page.next_key is None:
                    return at_version, found
                after = page.next_key
        except ServiceError as exc:
            raise from_service_error(exc) from exc

    async def range(self, request: rpc_pb2.RangeRequest) -> rpc_pb2.RangeResponse:
        keys = KeyRange.of(request.key, request.range_end)
        await self.link.barrier(request.serializable)
        _version, entries = self._read(keys, request.revision)
        return self._range_response(request, entries, self.header())

    @staticmethod
    def _range_response(request: rpc_pb2.RangeRequest, entries: list[Entry],
                        header: rpc_pb2.ResponseHeader | None) -> rpc_pb2.RangeResponse:
        count = len(entries)  # as etcd: the range's keys, before the revision bounds prune them
        bounds = ((request.min_mod_revision, request.max_mod_revision, lambda entry: entry.mod_version),
                  (request.min_create_revision, request.max_create_revision, lambda entry: entry.create_version))
        for low, high, revision_of in bounds:
            if low or high:
                entries = [entry for entry in entries
                           if (not low or revision_of(entry) >= low) and (not high or revision_of(entry) <= high)]
        order, target = request.sort_order, request.sort_target
        if order == rpc_pb2.RangeRequest.NONE and target != rpc_pb2.RangeRequest.KEY:
            order = rpc_pb2.RangeRequest.ASCEND  # as etcd: a sort target without an order ascends
        if order != rpc_pb2.RangeRequest.NONE:
            entries = sorted(entries, key=_SORT_KEYS[target],  # type: ignore[arg-type]
                             reverse=order == rpc_pb2.RangeRequest.DESCEND)
        limit = request.limit if request.limit > 0 else len(entries)
        response = rpc_pb2.RangeResponse(count=count, more=len(entries) > limit)
        if header is not None:
            response.header.CopyFrom(header)
        if not request.count_only:
            response.kvs.extend(key_value(entry, request.keys_only) for entry in entries[:limit])
        return response

    # ---- writes --------------------------------------------------------------------

    async def put(self, request: rpc_pb2.PutRequest) -> rpc_pb2.PutResponse:
        if not request.key:
            raise etcd_error(EMPTY_KEY)
        txn = rpc_pb2.TxnRequest(success=[rpc_pb2.RequestOp(request_put=request)])
        answer = await self.txn(txn)
        response = answer.responses[0].response_put
        response.header.CopyFrom(answer.header)  # a Put's own answer carries the full header
        return response

    async def delete_range(self, request: rpc_pb2.DeleteRangeRequest) -> rpc_pb2.DeleteRangeResponse:
        txn = rpc_pb2.TxnRequest(success=[rpc_pb2.RequestOp(request_delete_range=request)])
        answer = await self.txn(txn)
        response = answer.responses[0].response_delete_range
        response.header.CopyFrom(answer.header)
        return response

    async def txn(self, request: rpc_pb2.TxnRequest) -> rpc_pb2.TxnResponse:
        """etcd's Txn (Put and DeleteRange are one-op Txns): read what it depends on,
        decide, write guarded; again while a guard fails."""
        check_txn_request(request)
        for _attempt in range(GUARDED_ATTEMPTS):
            plan = await self._plan(request)
            if all(op.kind == OpKind.GET for op in plan.ops):
                # nothing to write (gets only, a delete of nothing): etcd takes no revision
                return plan.response(plan.read_locally(), self.header())
            result = await self.link.txn(plan.guard, tuple(plan.ops))
            if result.succeeded:
                return plan.response(result.ops, self.header(result.version))
        raise EtcdError(grpc.StatusCode.UNAVAILABLE, "metakv: the keys kept changing; retry")

    async def _plan(self, request: rpc_pb2.TxnRequest) -> _Plan:
        ops = (*request.success, *request.failure)
        needs_read = (bool(request.compare) or any(_reads_state(op) for op in ops)
                      or all(op.WhichOneof("request") == "request_range" for op in ops))
        if needs_read:
            await self.link.barrier(serializable=False)
        reads = _Reads(self)
        succeeded = all(reads.holds(compare) for compare in request.compare)
        plan = _Plan(succeeded, reads)
        for op in request.success if succeeded else request.failure:
            plan.add(op)
        return plan

    async def compact(self, request: rpc_pb2.CompactionRequest) -> rpc_pb2.CompactionResponse:
        """Checks the revision as etcd does; metakv's history horizon then moves by its own
        rules (docs/compaction.md: retention and the cleaner), not by this call."""
        header = self.header()
        oldest = self.service.status().get("oldest_version", 0)
        if request.revision > header.revision:
            raise etcd_error(FUTURE_REVISION)
        if request.revision < oldest:
            raise compacted(oldest)
        return rpc_pb2.CompactionResponse(header=header)

    # ---- leases (docs/leases.md) ----------------------------------------------------

    async def lease_grant(self, request: rpc_pb2.LeaseGrantRequest) -> rpc_pb2.LeaseGrantResponse:
        """ID 0: metakv picks one. As etcd, a TTL below the minimum (0 or less too) is raised
        to it: metakv raises any TTL from 1 up to its minimum (3 election timeouts)."""
        if request.ID and not 0 < request.ID <= MAX_LEASE_ID:
            raise invalid(f"a lease ID is 1..{MAX_LEASE_ID} (metakv's lease ids), or 0 for one picked by metakv")
        granted = await self.link.grant_lease(max(request.TTL, 1), request.ID or None)
        return rpc_pb2.LeaseGrantResponse(header=self.header(granted.version), ID=granted.id, TTL=granted.ttl_s)

    async def lease_revoke(self, request: rpc_pb2.LeaseRevokeRequest) -> rpc_pb2.LeaseRevokeResponse:
        revoked = await self.link.revoke_lease(lease_id(request.ID))
        return rpc_pb2.LeaseRevokeResponse(header=self.header(revoked.version))

    async def lease_keep_alive(self, ids: list[int]) -> list[rpc_pb2.LeaseKeepAliveResponse]:
        """One keep-alive of each id (one leadership confirmation for all), answered in order;
        as etcd, a lease that does not exist answers TTL 0."""
        known = [etcd_id for etcd_id in ids if 0 < etcd_id <= MAX_LEASE_ID]
        kept = dict((await self.link.keep_alive_leases(sorted(set(known)))).kept) if known else {}
        header = self.header()
        return [rpc_pb2.LeaseKeepAliveResponse(header=header, ID=etcd_id, TTL=kept.get(etcd_id, 0))
                for etcd_id in ids]

    async def lease_time_to_live(self, request: rpc_pb2.LeaseTimeToLiveRequest
                                 ) -> rpc_pb2.LeaseTimeToLiveResponse:
        """As etcd, a lease that does not exist answers TTL -1 (not an error)."""
        try:
            info = await self.link.lease_info(lease_id(request.ID), request.keys)
        except EtcdError as exc:
            if (exc.code, exc.message) != LEASE_NOT_FOUND:
                raise
            return rpc_pb2.LeaseTimeToLiveResponse(header=self.header(), ID=request.ID, TTL=-1)
        return rpc_pb2.LeaseTimeToLiveResponse(
            header=self.header(), ID=info.id, TTL=max(int(info.remaining_s), 0), grantedTTL=info.ttl_s,
            keys=[key.encode() for key in info.keys or []])

    async def lease_leases(self, request: rpc_pb2.LeaseLeasesRequest) -> rpc_pb2.LeaseLeasesResponse:
        await self.link.barrier(serializable=False)  # the leases as of a linearizable version
        try:
            page = self.service.list_leases()
        except ServiceError as exc:
            raise from_service_error(exc) from exc
        return rpc_pb2.LeaseLeasesResponse(header=self.header(page.version), leases=[
            rpc_pb2.LeaseStatus(ID=listed_id) for listed_id, _ttl_s in page.leases])

    # ---- maintenance and cluster ----------------------------------------------------

    def status(self) -> rpc_pb2.StatusResponse:
        status = self.service.status()
        return rpc_pb2.StatusResponse(
            header=self.header(), version=ETCD_API_VERSION, dbSize=status.get("log_size_bytes", 0),
            leader=max(status["leader_id"], 0), raftIndex=status["high_watermark"], raftTerm=status["epoch"],
            raftAppliedIndex=status["applied_version"], dbSizeInUse=status.get("log_size_bytes", 0),
            isLearner=not status["voter"])

    async def member_list(self) -> rpc_pb2.MemberListResponse:
        """The voters and the observers (as learners), from the leader's quorum view, each
        with its etcd client URL: this node's own, the others' from their /v1/status
        (``etcd_client_url``), asked once and remembered."""
        try:
            quorum = await self.link.quorum()
        except EtcdError:
            quorum = None  # no leader: the configured voters, URLs as far as known
        members: dict[int, tuple[bool, str]] = {node_id: (False, "") for node_id in self.member_urls}
        if quorum is not None:
            members = {replica["node_id"]: (False, replica["endpoint"] or "") for replica in quorum["voters"]}
            members.update({replica["node_id"]: (True, replica["endpoint"] or "") for replica in quorum["observers"]})
        unknown = [(node_id, http_url) for node_id, (_learner, http_url) in members.items()
                   if http_url and not self.member_urls.get(node_id)]
        statuses = await asyncio.gather(*(self.link.member_status(http_url) for _node_id, http_url in unknown))
        for (node_id, _http_url), status in zip(unknown, statuses, strict=True):
            if status is not None and status.get("etcd_client_url"):
                self.member_urls[node_id] = [str(status["etcd_client_url"])]
        # as etcd: a call that does not touch the key-value store has revision 0 (unset)
        return rpc_pb2.MemberListResponse(header=self.header(0), members=[
            rpc_pb2.Member(ID=node_id, name=f"metakv-{node_id}", clientURLs=self.member_urls.get(node_id, []),
                           isLearner=learner)
            for node_id, (learner, _http_url) in sorted(members.items())])


def _reads_state(op: rpc_pb2.RequestOp) -> bool:
    """Whether an op's effect depends on state metakv's txn cannot compare itself."""
    kind = op.WhichOneof("request")
    if kind == "request_put":
        return op.request_put.ignore_value or op.request_put.ignore_lease
    if kind == "request_delete_range":
        return bool(op.request_delete_range.range_end)
    if kind == "request_range":
        return bool(op.request_range.range_end)
    return kind == "request_txn"


def check_txn_request(request: rpc_pb2.TxnRequest, max_ops: int = MAX_TXN_OPS) -> None:
    """etcd's checks of a txn tree before it runs (v3rpc checkTxnRequest, checkIntervals):
    sizes, keys given, and no key put twice or put and deleted on one path through it."""
    _check_ops(request, max_ops)
    for branch in (request.success, request.failure):
        _put_and_deleted_keys(branch)


def _check_ops(request: rpc_pb2.TxnRequest, max_ops: int) -> None:
    widest = max(len(request.compare), len(request.success), len(request.failure))
    if widest > max_ops:
        raise etcd_error(TOO_MANY_OPS)
    if any(not compare.key for compare in request.compare):
        raise etcd_error(EMPTY_KEY)
    for compare in request.compare:  # etcd ignores an unknown one; metakv says so rather than guess
        if compare.target not in _COMPARE_TARGETS or compare.result not in rpc_pb2.Compare.CompareResult.values():
            raise invalid(f"unknown compare target {compare.target} or result {compare.result}")
    for op in (*request.success, *request.failure):
        kind = op.WhichOneof("request")
        if kind is None:
            raise etcd_error(KEY_NOT_FOUND)  # as etcd: an empty op
        if kind == "request_txn":
            _check_ops(op.request_txn, max_ops - widest)  # as etcd: what the outer txn left
            continue
        if not getattr(op, kind).key:
            raise etcd_error(EMPTY_KEY)
        if kind == "request_put" and op.request_put.ignore_value and op.request_put.value:
            raise etcd_error(VALUE_PROVIDED)
        if kind == "request_put" and op.request_put.ignore_lease and op.request_put.lease:
            raise etcd_error(LEASE_PROVIDED)
        if kind == "request_range" and (
                op.request_range.sort_order not in rpc_pb2.RangeRequest.SortOrder.values()
                or op.request_range.sort_target not in rpc_pb2.RangeRequest.SortTarget.values()):
            raise etcd_error(INVALID_SORT)


def _put_and_deleted_keys(ops: Sequence[rpc_pb2.RequestOp]) -> tuple[set[bytes], list[tuple[bytes, bytes]]]:
    """The keys ``ops`` put and the ranges they delete, nested txns included; raises etcd's
    duplicate key error as its checkIntervals does: a put may not meet another put or a
    delete of this level or an earlier nested txn, and a nested txn's two branches may
    put the same key (only one runs). Deletes are (key, range_end) as etcd's intervals:
    a range_end below the key (a zero byte: from the key on) meets no put, as in etcd."""
    deleted = [(op.request_delete_range.key, op.request_delete_range.range_end)
               for op in ops if op.WhichOneof("request") == "request_delete_range"]

    def meets_delete(key: bytes) -> bool:
        return any(key == start if not end else start <= key < end for start, end in deleted)

    put: set[bytes] = set()
    for op in ops:
        if op.WhichOneof("request") != "request_txn":
            continue
        then_put, then_deleted = _put_and_deleted_keys(op.request_txn.success)
        else_put, else_deleted = _put_and_deleted_keys(op.request_txn.failure)
        for key in then_put:
            if key in put or meets_delete(key):
                raise etcd_error(DUPLICATE_KEY)
        put |= then_put
        for key in else_put:
            if (key in put and key not in then_put) or meets_delete(key):
                raise etcd_error(DUPLICATE_KEY)
        put |= else_put
        deleted += then_deleted + else_deleted
    for op in ops:
        if op.WhichOneof("request") != "request_put":
            continue
        if op.request_put.key in put or meets_delete(op.request_put.key):
            raise etcd_error(DUPLICATE_KEY)
        put.add(op.request_put.key)
    return put, deleted


class _Reads:
    """Keys read (at this node's applied state, after a barrier) for a txn's decision, each
    remembered with its mod_version for the guard."""

    def __init__(self, mapping: EtcdMapping) -> None:
        self.mapping = mapping
        self.seen: dict[str, int] = {}  # key -> its mod_version when read (0: absent)

    def entries(self, keys: KeyRange) -> list[Entry]:
        _version, found = self.mapping._read(keys, 0)
        if keys.single:
            self.seen.setdefault(text_key(keys.start), found[0].mod_version if found else 0)
        for entry in found:
            self.seen.setdefault(entry.key, entry.mod_version)
        return found

    def holds(self, compare: rpc_pb2.Compare) -> bool:
        keys = KeyRange.of(compare.key, compare.range_end)
        found = self.entries(keys)
        field, of_entry = _COMPARE_TARGETS[compare.target]
        if not found:  # as etcd: no key compares as versions 0, and never by value
            return compare.target != rpc_pb2.Compare.VALUE and _compare(0, compare.result, getattr(compare, field))
        wanted = getattr(compare, field)
        return all(_compare(of_entry(entry), compare.result, wanted) for entry in found)


# Compare.CompareTarget -> (the request's field holding the wanted value, the entry's value)
_COMPARE_TARGETS: dict[int, tuple[str, Callable[[Entry], object]]] = {
    rpc_pb2.Compare.VERSION: ("version", lambda entry: entry.key_version),
    rpc_pb2.Compare.CREATE: ("create_revision", lambda entry: entry.create_version),
    rpc_pb2.Compare.MOD: ("mod_revision", lambda entry: entry.mod_version),
    rpc_pb2.Compare.VALUE: ("value", lambda entry: entry.value),
    rpc_pb2.Compare.LEASE: ("lease", lambda entry: entry.lease),
}


def _compare(value: object, result: int, wanted: object) -> bool:
    if result == rpc_pb2.Compare.EQUAL:
        return value == wanted
    if result == rpc_pb2.Compare.NOT_EQUAL:
        return value != wanted
    if result == rpc_pb2.Compare.GREATER:
        return value > wanted  # type: ignore[operator]
    return value < wanted  # type: ignore[operator]


# An op's answer from the results of its own ops in the plan.
BuildAnswer = Callable[[Sequence[OpResult]], rpc_pb2.ResponseOp]


@dataclass(slots=True)
class _OpAnswer:
    build: BuildAnswer
    start: int  # its ops in the plan: [start, end)
    end: int


@dataclass(slots=True)
class _NestedTxn:
    succeeded: bool
    answers: list[_OpAnswer | _NestedTxn] = field(default_factory=list)


class _Plan:
    """The ops of the chosen branches (nested txns' too, in order) as one metakv txn, and
    how to answer it."""

    def __init__(self, succeeded: bool, reads: _Reads) -> None:
        self.succeeded = succeeded
        self.reads = reads
        self.ops: list[Op] = []
        self.answers: list[_OpAnswer | _NestedTxn] = []

    @property
    def guard(self) -> tuple[Compare, ...]:
        return tuple(Compare(key, CompareKind.MOD_VERSION, mod_version)
                     for key, mod_version in sorted(self.reads.seen.items()))

    def _take(self, ops: Iterable[Op], build: BuildAnswer) -> None:
        start = len(self.ops)
        self.ops.extend(ops)
        self.answers.append(_OpAnswer(build, start, len(self.ops)))

    def add(self, op: rpc_pb2.RequestOp) -> None:
        kind = op.WhichOneof("request")
        if kind == "request_put":
            self._put(op.request_put)
        elif kind == "request_delete_range":
            self._delete(op.request_delete_range)
        elif kind == "request_range":
            self._range(op.request_range)
        elif kind == "request_txn":
            self._nested(op.request_txn)
        else:
            raise etcd_error(KEY_NOT_FOUND)  # as etcd: an empty op

    def _nested(self, txn: rpc_pb2.TxnRequest) -> None:
        """As etcd: its compares see the state before the whole txn (the same reads as the
        outer compares); its chosen ops run in place, after the ops before it."""
        nested = _NestedTxn(all(self.reads.holds(compare) for compare in txn.compare))
        outer, self.answers = self.answers, nested.answers
        try:
            for op in txn.success if nested.succeeded else txn.failure:
                self.add(op)
        finally:
            self.answers = outer
        self.answers.append(nested)

    def _put(self, put: rpc_pb2.PutRequest) -> None:
        key = text_key(put.key)
        value, lease = put.value, lease_id(put.lease) if put.lease else 0
        if put.ignore_value or put.ignore_lease:  # the key's own value or lease, as it is now
            found = self.reads.entries(KeyRange(put.key, None, True))
            if not found:
                raise etcd_error(KEY_NOT_FOUND)
            value = found[0].value if put.ignore_value else value
            lease = found[0].lease if put.ignore_lease else lease
        if len(value) > self.reads.mapping.service.max_value_bytes:  # the HTTP API's bound, as for keys
            raise etcd_error(TOO_LARGE)
        ops = ([Op(OpKind.GET, key)] if put.prev_kv else []) + [Op(OpKind.PUT, key, value, DEFAULT_CONTENT_TYPE,
                                                                   lease=lease)]

        def answer(results: Sequence[OpResult]) -> rpc_pb2.ResponseOp:
            response = rpc_pb2.PutResponse()
            if put.prev_kv and results[0].entry is not None:
                response.prev_kv.CopyFrom(key_value(results[0].entry))
            return rpc_pb2.ResponseOp(response_put=response)
        self._take(ops, answer)

    def _keys_of(self, key: bytes, range_end: bytes) -> list[str]:
        """The keys of a range as the op will find them: those read now, and those an
        earlier op of this txn puts (as in etcd, an op sees the txn's earlier writes)."""
        keys = KeyRange.of(key, range_end)
        if keys.single:
            return [text_key(keys.start)]
        found = {entry.key for entry in self.reads.entries(keys)}
        found.update(op.key for op in self.ops if op.kind == OpKind.PUT and keys.holds(op.key.encode()))
        return sorted(found)  # code point order is UTF-8 byte order

    def _delete(self, delete: rpc_pb2.DeleteRangeRequest) -> None:
        keys = self._keys_of(delete.key, delete.range_end)
        reads = [Op(OpKind.GET, key) for key in keys] if delete.prev_kv else []  # prev_kvs only when asked

        def answer(results: Sequence[OpResult]) -> rpc_pb2.ResponseOp:
            previous, deletes = results[:len(reads)], results[len(reads):]
            response = rpc_pb2.DeleteRangeResponse(deleted=sum(1 for result in deletes if result.deleted))
            response.prev_kvs.extend(key_value(result.entry) for result in previous if result.entry is not None)
            return rpc_pb2.ResponseOp(response_delete_range=response)
        self._take(reads + [Op(OpKind.DELETE, key) for key in keys], answer)

    def _range(self, request: rpc_pb2.RangeRequest) -> None:
        if request.revision > 0:
            raise unimplemented("a range at a revision inside a txn is not supported")
        keys = self._keys_of(request.key, request.range_end)

        def answer(results: Sequence[OpResult]) -> rpc_pb2.ResponseOp:
            entries = [result.entry for result in results if result.entry is not None]
            return rpc_pb2.ResponseOp(response_range=EtcdMapping._range_response(request, entries, None))
        self._take([Op(OpKind.GET, key) for key in keys], answer)

    def read_locally(self) -> list[OpResult]:
        """The results of a plan of gets only, read from this node (after its barrier)."""
        service = self.reads.mapping.service
        try:
            return [OpResult(OpKind.GET, op.key, False, False, service.get(op.key).entry) for op in self.ops]
        except ServiceError as exc:
            raise from_service_error(exc) from exc

    def response(self, results: Sequence[OpResult], header: rpc_pb2.ResponseHeader) -> rpc_pb2.TxnResponse:
        """As etcd, an op's own header holds only a revision: the txn's once the txn changed
        something at or before that op, the one before it until then; a nested txn's
        header is empty."""
        changes = [index for index, result in enumerate(results[:len(self.ops)])
                   if result.kind == OpKind.PUT or result.deleted]
        first_change = changes[0] if changes else len(self.ops)
        before = header.revision - 1 if changes else header.revision

        def render(answers: list[_OpAnswer | _NestedTxn]) -> list[rpc_pb2.ResponseOp]:
            responses = []
            for answer in answers:
                if isinstance(answer, _NestedTxn):
                    responses.append(rpc_pb2.ResponseOp(response_txn=rpc_pb2.TxnResponse(
                        header=rpc_pb2.ResponseHeader(), succeeded=answer.succeeded,
                        responses=render(answer.answers))))
                    continue
                response = answer.build(results[answer.start:answer.end])
                getattr(response, response.WhichOneof("response")).header.revision = (
                    header.revision if first_change < answer.end else before)
                responses.append(response)
            return responses
        return rpc_pb2.TxnResponse(header=header, succeeded=self.succeeded, responses=render(self.answers))
