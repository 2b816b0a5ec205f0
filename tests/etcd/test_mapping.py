"""etcd's KV, Maintenance and Cluster calls over gRPC against an in-process node: what an
etcd client sees (revisions, per-key versions, compares, prev_kv, errors, headers)."""

from __future__ import annotations

import grpc
import pytest

from app.etcd.mapping import cluster_number, prefix_end
from app.etcd.protos import rpc_pb2
from tests.etcd.conftest import Stubs
from tests.http.service_double import InProcessService

pytestmark = pytest.mark.anyio
R = rpc_pb2.RangeRequest


async def put(etcd: Stubs, key: bytes, value: bytes, **options: object) -> rpc_pb2.PutResponse:
    return await etcd.kv.Put(rpc_pb2.PutRequest(key=key, value=value, **options))


async def test_put_and_range_carry_etcd_revisions_versions_and_headers(etcd: Stubs) -> None:
    first = await put(etcd, b"app/a", b"1")
    await put(etcd, b"app/a", b"2")
    await put(etcd, b"app/b", b"3")
    await put(etcd, b"other", b"4")
    got = await etcd.kv.Range(R(key=b"app/", range_end=prefix_end(b"app/")))
    assert [(kv.key, kv.value, kv.version, kv.create_revision) for kv in got.kvs] == [
        (b"app/a", b"2", 2, first.header.revision), (b"app/b", b"3", 1, first.header.revision + 2)]
    assert got.count == 2 and not got.more
    assert got.header.revision == first.header.revision + 3
    assert got.header.cluster_id == cluster_number("test-cluster") and got.header.member_id == 1
    assert got.header.raft_term == 1
    everything = await etcd.kv.Range(R(key=b"\0", range_end=b"\0"))
    assert [kv.key for kv in everything.kvs] == [b"app/a", b"app/b", b"other"]
    from_key = await etcd.kv.Range(R(key=b"app/b", range_end=b"\0", serializable=True))
    assert [kv.key for kv in from_key.kvs] == [b"app/b", b"other"]
    between = await etcd.kv.Range(R(key=b"app/a", range_end=b"app/b"))
    assert [kv.key for kv in between.kvs] == [b"app/a"]
    assert not (await etcd.kv.Range(R(key=b"other", range_end=b"app/"))).kvs  # an empty range


async def test_range_limit_sort_count_and_keys_only(etcd: Stubs) -> None:
    for key, value in ((b"k1", b"c"), (b"k2", b"a"), (b"k3", b"b")):
        await put(etcd, key, value)
    prefix = {"key": b"k", "range_end": prefix_end(b"k")}
    limited = await etcd.kv.Range(R(**prefix, limit=2))
    assert [kv.key for kv in limited.kvs] == [b"k1", b"k2"] and limited.count == 3 and limited.more
    by_value = await etcd.kv.Range(R(**prefix, sort_order=R.DESCEND, sort_target=R.VALUE))
    assert [kv.value for kv in by_value.kvs] == [b"c", b"b", b"a"]
    counted = await etcd.kv.Range(R(**prefix, count_only=True))
    assert counted.count == 3 and not counted.kvs
    keys = await etcd.kv.Range(R(**prefix, keys_only=True))
    assert [(kv.key, kv.value) for kv in keys.kvs] == [(b"k1", b""), (b"k2", b""), (b"k3", b"")]


async def test_revision_bounds_prune_kvs_but_not_the_count(etcd: Stubs) -> None:
    """As etcd (apply.go Range): count is the range's keys before min/max_mod_revision and
    min/max_create_revision prune them; more says whether the pruned list passed the limit.
    Checked against etcd 3.4 by hand."""
    first = (await put(etcd, b"m/a", b"1")).header.revision
    await put(etcd, b"m/b", b"2")
    await put(etcd, b"m/a", b"3")
    await put(etcd, b"m/c", b"4")
    prefix = {"key": b"m/", "range_end": prefix_end(b"m/")}
    recent = await etcd.kv.Range(R(**prefix, min_mod_revision=first + 2))
    assert [kv.key for kv in recent.kvs] == [b"m/a", b"m/c"] and recent.count == 3 and not recent.more
    old = await etcd.kv.Range(R(**prefix, max_create_revision=first))
    assert [kv.key for kv in old.kvs] == [b"m/a"] and old.count == 3
    limited = await etcd.kv.Range(R(**prefix, min_create_revision=first + 1, limit=1))
    assert [kv.key for kv in limited.kvs] == [b"m/b"] and limited.count == 3 and limited.more


async def test_range_at_a_revision_and_the_compacted_and_future_errors(etcd: Stubs, service: InProcessService) -> None:
    old = await put(etcd, b"k", b"old")
    await put(etcd, b"k", b"new")
    at = await etcd.kv.Range(R(key=b"k", revision=old.header.revision))
    assert [kv.value for kv in at.kvs] == [b"old"]
    with pytest.raises(grpc.aio.AioRpcError) as future:
        await etcd.kv.Range(R(key=b"k", revision=old.header.revision + 10))
    assert future.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert future.value.details() == "etcdserver: mvcc: required revision is a future revision"
    service.state.prune_history(old.header.revision + 1)
    with pytest.raises(grpc.aio.AioRpcError) as compacted:
        await etcd.kv.Range(R(key=b"k", revision=old.header.revision))
    assert compacted.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert compacted.value.details() == "etcdserver: mvcc: required revision has been compacted"


async def test_put_and_delete_return_prev_kv_and_ignore_value_keeps_the_value(etcd: Stubs) -> None:
    assert not (await put(etcd, b"k", b"1", prev_kv=True)).HasField("prev_kv")
    second = await put(etcd, b"k", b"2", prev_kv=True)
    assert (second.prev_kv.value, second.prev_kv.version) == (b"1", 1)
    await put(etcd, b"k", b"", ignore_value=True)
    kept = (await etcd.kv.Range(R(key=b"k"))).kvs[0]
    assert (kept.value, kept.version) == (b"2", 3)
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await put(etcd, b"absent", b"", ignore_value=True)
    assert missing.value.details() == "etcdserver: key not found"
    await put(etcd, b"k2", b"x")
    deleted = await etcd.kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=b"k", range_end=prefix_end(b"k"), prev_kv=True))
    assert deleted.deleted == 2 and [kv.key for kv in deleted.prev_kvs] == [b"k", b"k2"]
    again = await put(etcd, b"k", b"3")
    assert (await etcd.kv.Range(R(key=b"k"))).kvs[0].version == 1  # a delete resets the version
    assert again.header.revision == deleted.header.revision + 1


async def test_txn_compares_on_version_create_mod_and_value(etcd: Stubs) -> None:
    created = await put(etcd, b"lock", b"a")
    await put(etcd, b"lock", b"b")
    C = rpc_pb2.Compare

    async def txn(*compares: rpc_pb2.Compare) -> rpc_pb2.TxnResponse:
        return await etcd.kv.Txn(rpc_pb2.TxnRequest(
            compare=list(compares),
            success=[rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=b"won", value=b"yes"))],
            failure=[rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=b"lock"))]))

    holds = await txn(C(key=b"lock", target=C.VERSION, result=C.EQUAL, version=2),
                      C(key=b"lock", target=C.CREATE, result=C.EQUAL, create_revision=created.header.revision),
                      C(key=b"lock", target=C.MOD, result=C.GREATER, mod_revision=created.header.revision),
                      C(key=b"lock", target=C.VALUE, result=C.NOT_EQUAL, value=b"a"),
                      C(key=b"missing", target=C.VERSION, result=C.EQUAL, version=0))
    assert holds.succeeded and holds.responses[0].response_put.header.revision == holds.header.revision
    fails = await txn(C(key=b"lock", target=C.VERSION, result=C.LESS, version=2))
    assert not fails.succeeded
    assert [kv.value for kv in fails.responses[0].response_range.kvs] == [b"b"]
    assert (await etcd.kv.Range(R(key=b"won"))).kvs[0].value == b"yes"
    never = await txn(C(key=b"missing", target=C.VALUE, result=C.NOT_EQUAL, value=b"x"))
    assert not never.succeeded  # as etcd: a missing key compares false on its value


async def test_compact_checks_the_revision(etcd: Stubs) -> None:
    written = await put(etcd, b"k", b"v")
    assert (await etcd.kv.Compact(rpc_pb2.CompactionRequest(revision=written.header.revision))).header.revision
    with pytest.raises(grpc.aio.AioRpcError) as future:
        await etcd.kv.Compact(rpc_pb2.CompactionRequest(revision=written.header.revision + 5))
    assert future.value.code() == grpc.StatusCode.OUT_OF_RANGE


async def test_bad_input_gets_etcds_errors(etcd: Stubs) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as empty:
        await put(etcd, b"", b"v")
    assert (empty.value.code(), empty.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                           "etcdserver: key is not provided")
    with pytest.raises(grpc.aio.AioRpcError) as lease:
        await put(etcd, b"k", b"v", lease=7)
    assert (lease.value.code(), lease.value.details()) == (grpc.StatusCode.NOT_FOUND,
                                                           "etcdserver: requested lease not found")
    with pytest.raises(grpc.aio.AioRpcError) as binary:
        await put(etcd, b"\xff", b"v")
    assert binary.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in binary.value.details()


async def test_keys_and_values_the_http_api_refuses_are_refused_on_every_member(
        etcd: Stubs, service: InProcessService) -> None:
    """A follower forwards through the HTTP API, which refuses these: the leader took them
    and a follower answered "no leader" for the same put."""
    refusals = [
        (b"k" * 1025, b"v", (grpc.StatusCode.INVALID_ARGUMENT, "metakv: a key is at most 1024 bytes (this one is 1025)")),
        (b"a\0b", b"v", (grpc.StatusCode.INVALID_ARGUMENT, "metakv: a key may not contain a zero byte")),
        (b"k", b"x" * (service.max_value_bytes + 1), (grpc.StatusCode.INVALID_ARGUMENT,
                                                      "etcdserver: request is too large")),
    ]
    for key, value, answer in refusals:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await put(etcd, key, value)
        assert (refused.value.code(), refused.value.details()) == answer
    await put(etcd, b"k" * 1024, b"x" * service.max_value_bytes)  # the bounds themselves are fine


async def test_status_member_list_and_alarm(etcd: Stubs) -> None:
    await put(etcd, b"k", b"v")
    status = await etcd.maintenance.Status(rpc_pb2.StatusRequest())
    assert status.leader == 1 and status.raftTerm == 1 and status.raftAppliedIndex == status.header.revision
    assert status.version and not status.isLearner
    members = await etcd.cluster.MemberList(rpc_pb2.MemberListRequest())
    assert [(m.ID, list(m.clientURLs), m.isLearner) for m in members.members] == [(1, ["http://127.0.0.1:1"], False)]
    alarms = await etcd.maintenance.Alarm(rpc_pb2.AlarmRequest())
    assert not alarms.alarms and alarms.header.member_id == 1



def put_op(key: bytes, value: bytes = b"v", **options: object) -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key, value=value, **options))


def range_op(key: bytes, range_end: bytes = b"") -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(request_range=R(key=key, range_end=range_end))


def delete_op(key: bytes, range_end: bytes = b"") -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=key, range_end=range_end))


def nested(compare: list[rpc_pb2.Compare], success: list[rpc_pb2.RequestOp],
           failure: list[rpc_pb2.RequestOp] = []) -> rpc_pb2.RequestOp:  # noqa: B006  (never mutated)
    return rpc_pb2.RequestOp(request_txn=rpc_pb2.TxnRequest(compare=compare, success=success, failure=failure))


def value_is(key: bytes, value: bytes) -> rpc_pb2.Compare:
    return rpc_pb2.Compare(key=key, target=rpc_pb2.Compare.VALUE, result=rpc_pb2.Compare.EQUAL, value=value)


async def test_a_nested_txn_decides_on_the_state_before_the_whole_txn(etcd: Stubs) -> None:
    before = await put(etcd, b"n/a", b"1")
    answer = await etcd.kv.Txn(rpc_pb2.TxnRequest(compare=[value_is(b"n/a", b"1")], success=[
        range_op(b"n/a"), put_op(b"n/b"),
        # n/b is put above, but as in etcd the nested compare sees the state before the txn
        nested([value_is(b"n/a", b"1"), value_is(b"n/b", b"v")], [put_op(b"n/c")],
               [range_op(b"n/", prefix_end(b"n/")), put_op(b"n/d")])]))
    written = before.header.revision + 1
    assert answer.succeeded and answer.header.revision == written
    first, second, inner = answer.responses
    # as etcd: a range before the txn's first change answers the revision before it
    assert first.response_range.header.revision == before.header.revision
    assert second.response_put.header.revision == written
    assert inner.response_txn.header == rpc_pb2.ResponseHeader() and not inner.response_txn.succeeded
    seen, put_d = inner.response_txn.responses
    assert [kv.key for kv in seen.response_range.kvs] == [b"n/a", b"n/b"]  # the earlier put, as etcd
    assert seen.response_range.header.revision == put_d.response_put.header.revision == written
    keys = await etcd.kv.Range(R(key=b"n/", range_end=prefix_end(b"n/")))
    assert [(kv.key, kv.mod_revision) for kv in keys.kvs] == [(b"n/a", before.header.revision),
                                                               (b"n/b", written), (b"n/d", written)]
    outer_fails = await etcd.kv.Txn(rpc_pb2.TxnRequest(compare=[value_is(b"n/a", b"2")], failure=[
        nested([], [nested([value_is(b"n/d", b"v")], [delete_op(b"n/", prefix_end(b"n/"))])])]))
    assert not outer_fails.succeeded and outer_fails.header.revision == written + 1
    deepest = outer_fails.responses[0].response_txn.responses[0].response_txn
    assert deepest.succeeded and deepest.responses[0].response_delete_range.deleted == 3
    reads_only = await etcd.kv.Txn(rpc_pb2.TxnRequest(success=[nested([], [range_op(b"n/a")])]))
    assert reads_only.header.revision == written + 1  # as etcd: a txn of reads takes no revision


async def test_a_txn_tree_may_not_put_a_key_twice_or_put_and_delete_it(etcd: Stubs) -> None:
    refused = [
        [put_op(b"k"), put_op(b"k")],
        [put_op(b"k"), delete_op(b"k")],
        [delete_op(b"a", b"z"), nested([], [put_op(b"k")])],
        [nested([], [put_op(b"k")]), nested([], [], [put_op(b"k")])],
        [nested([], [delete_op(b"k")]), nested([], [put_op(b"k")])],
        [nested([], [delete_op(b"k")]), put_op(b"k")],
    ]
    for success in refused:
        with pytest.raises(grpc.aio.AioRpcError) as duplicate:
            await etcd.kv.Txn(rpc_pb2.TxnRequest(success=success))
        assert (duplicate.value.code(), duplicate.value.details()) == (
            grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: duplicate key given in txn request")
    assert not (await etcd.kv.Range(R(key=b"k"))).kvs
    # as etcd: a nested txn's branches may put one key (only one runs), and a put in one
    # nested txn may be deleted by a later one
    allowed = await etcd.kv.Txn(rpc_pb2.TxnRequest(success=[
        nested([value_is(b"k", b"x")], [put_op(b"k", b"then")], [put_op(b"k", b"else")]),
        nested([], [put_op(b"gone/1")]), nested([], [delete_op(b"gone/", prefix_end(b"gone/"))])]))
    assert allowed.responses[2].response_txn.responses[0].response_delete_range.deleted == 1
    assert [kv.value for kv in (await etcd.kv.Range(R(key=b"k"))).kvs] == [b"else"]
    assert not (await etcd.kv.Range(R(key=b"gone/1"))).kvs


async def test_a_txn_tree_gets_etcds_request_checks(etcd: Stubs) -> None:
    checks = [
        (rpc_pb2.TxnRequest(success=[rpc_pb2.RequestOp()]), "etcdserver: key not found"),
        (rpc_pb2.TxnRequest(success=[nested([rpc_pb2.Compare(target=rpc_pb2.Compare.VERSION)], [])]),
         "etcdserver: key is not provided"),
        (rpc_pb2.TxnRequest(failure=[nested([], [put_op(b"k", b"v", ignore_value=True)])]),
         "etcdserver: value is provided"),
        # as etcd: a nested txn may hold what the outer txn's widest list left of the 128
        (rpc_pb2.TxnRequest(success=[*(put_op(b"o%d" % n) for n in range(100)),
                                     nested([], [put_op(b"i%d" % n) for n in range(28)])]),
         "etcdserver: too many operations in txn request"),
        # an enum value etcd's .proto does not define (before: UNKNOWN, a KeyError)
        (rpc_pb2.TxnRequest(compare=[rpc_pb2.Compare(key=b"k", target=9)]),  # type: ignore[arg-type]
         "metakv: unknown compare target 9 or result 0"),
        (rpc_pb2.TxnRequest(success=[nested([rpc_pb2.Compare(key=b"k", result=7)], [])]),  # type: ignore[arg-type]
         "metakv: unknown compare target 0 or result 7"),
    ]
    for request, message in checks:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await etcd.kv.Txn(request)
        assert (refused.value.code(), refused.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)



async def test_calls_metakv_does_not_serve_answer_unimplemented_with_metakvs_message(etcd: Stubs) -> None:
    """docs/etcd.md promises a message starting "metakv:"; grpc said "Unexpected <class
    'NotImplementedError'>: Method not implemented!" (etcdctl defrag, member add, snapshot)."""
    calls = [("Maintenance.Defragment", etcd.maintenance.Defragment(rpc_pb2.DefragmentRequest())),
             ("Cluster.MemberAdd", etcd.cluster.MemberAdd(rpc_pb2.MemberAddRequest(peerURLs=["http://h:1"]))),
             ("Maintenance.Snapshot", etcd.maintenance.Snapshot(rpc_pb2.SnapshotRequest()).read())]
    for name, call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call
        assert (refused.value.code(), refused.value.details()) == (
            grpc.StatusCode.UNIMPLEMENTED, f"metakv: {name} is not served (docs/etcd.md)")
