"""etcd's Lease service over gRPC against an in-process node: grant, keep-alive stream,
time-to-live, list, revoke (with the keys attached by Put), and etcd's answers for leases
that do not exist."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from app.etcd.protos import kv_pb2, rpc_pb2
from tests.etcd.conftest import Stubs
from tests.etcd.test_watch import Stream

pytestmark = pytest.mark.anyio
NOT_FOUND = (grpc.StatusCode.NOT_FOUND, "etcdserver: requested lease not found")


async def grant(etcd: Stubs, ttl: int, lease_id: int = 0) -> rpc_pb2.LeaseGrantResponse:
    return await etcd.lease.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=ttl, ID=lease_id))


async def test_grant_attach_time_to_live_and_revoke_deletes_the_keys(etcd: Stubs) -> None:
    lease = await grant(etcd, 30)
    assert lease.ID > 0 and lease.TTL == 30 and lease.header.revision > 0
    await etcd.kv.Put(rpc_pb2.PutRequest(key=b"svc/a", value=b"1", lease=lease.ID))
    await etcd.kv.Put(rpc_pb2.PutRequest(key=b"svc/b", value=b"2", lease=lease.ID))
    await etcd.kv.Put(rpc_pb2.PutRequest(key=b"svc/keep", value=b"3"))
    got = await etcd.kv.Range(rpc_pb2.RangeRequest(key=b"svc/a"))
    assert got.kvs[0].lease == lease.ID
    ttl = await etcd.lease.LeaseTimeToLive(rpc_pb2.LeaseTimeToLiveRequest(ID=lease.ID, keys=True))
    assert (ttl.ID, ttl.grantedTTL, sorted(ttl.keys)) == (lease.ID, 30, [b"svc/a", b"svc/b"])
    assert 0 < ttl.TTL <= 30
    listed = await etcd.lease.LeaseLeases(rpc_pb2.LeaseLeasesRequest())
    assert [status.ID for status in listed.leases] == [lease.ID]
    watch = Stream(etcd)
    try:
        watch.create(key=b"svc/a", start_revision=got.kvs[0].mod_revision)
        assert (await watch.next()).created
        assert [event.kv.lease for event in (await watch.next()).events] == [lease.ID]
        revoked = await etcd.lease.LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=lease.ID))
        deleted = (await watch.next()).events
        assert [(event.type, event.kv.mod_revision) for event in deleted] == [
            (kv_pb2.Event.DELETE, revoked.header.revision)]
    finally:
        watch.close()
    left = await etcd.kv.Range(rpc_pb2.RangeRequest(key=b"svc/", range_end=b"svc0"))
    assert [kv.key for kv in left.kvs] == [b"svc/keep"]
    assert left.header.revision == revoked.header.revision  # both keys went in one revision
    assert not (await etcd.lease.LeaseLeases(rpc_pb2.LeaseLeasesRequest())).leases


async def test_chosen_id_and_ttl_bounds(etcd: Stubs) -> None:
    chosen = await grant(etcd, 20, lease_id=4242)
    assert chosen.ID == 4242
    with pytest.raises(grpc.aio.AioRpcError) as taken:
        await grant(etcd, 20, lease_id=4242)
    assert (taken.value.code(), taken.value.details()) == (grpc.StatusCode.FAILED_PRECONDITION,
                                                           "etcdserver: lease already exists")
    raised = await grant(etcd, 0)  # as etcd: a TTL below the minimum is raised to it
    assert raised.TTL >= 1
    with pytest.raises(grpc.aio.AioRpcError) as too_large:
        await grant(etcd, 10**9)
    assert (too_large.value.code(), too_large.value.details()) == (grpc.StatusCode.OUT_OF_RANGE,
                                                                   "etcdserver: too large lease TTL")
    with pytest.raises(grpc.aio.AioRpcError) as negative:
        await grant(etcd, 10, lease_id=-5)
    assert negative.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_keep_alive_stream_answers_each_request(etcd: Stubs) -> None:
    first, second = await grant(etcd, 15), await grant(etcd, 25)

    async def requests() -> AsyncIterator[rpc_pb2.LeaseKeepAliveRequest]:
        for lease_id in (first.ID, second.ID, 999_999, first.ID):
            yield rpc_pb2.LeaseKeepAliveRequest(ID=lease_id)

    answers = [(answer.ID, answer.TTL) async for answer in etcd.lease.LeaseKeepAlive(requests())]
    # as etcd: a lease that does not exist answers TTL 0
    assert answers == [(first.ID, 15), (second.ID, 25), (999_999, 0), (first.ID, 15)]


async def test_leases_that_do_not_exist(etcd: Stubs) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as revoke:
        await etcd.lease.LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=12345))
    assert (revoke.value.code(), revoke.value.details()) == NOT_FOUND
    ttl = await etcd.lease.LeaseTimeToLive(rpc_pb2.LeaseTimeToLiveRequest(ID=12345))
    assert ttl.TTL == -1  # as etcd: not an error
    with pytest.raises(grpc.aio.AioRpcError) as put:
        await etcd.kv.Put(rpc_pb2.PutRequest(key=b"k", value=b"v", lease=12345))
    assert (put.value.code(), put.value.details()) == NOT_FOUND
    assert not (await etcd.kv.Range(rpc_pb2.RangeRequest(key=b"k"))).kvs


async def test_ignore_lease_and_compare_on_lease(etcd: Stubs) -> None:
    lease = await grant(etcd, 30)
    await etcd.kv.Put(rpc_pb2.PutRequest(key=b"k", value=b"1", lease=lease.ID))
    await etcd.kv.Put(rpc_pb2.PutRequest(key=b"k", value=b"2", ignore_lease=True))
    kept = (await etcd.kv.Range(rpc_pb2.RangeRequest(key=b"k"))).kvs[0]
    assert (kept.value, kept.lease) == (b"2", lease.ID)
    with pytest.raises(grpc.aio.AioRpcError) as both:
        await etcd.kv.Put(rpc_pb2.PutRequest(key=b"k", value=b"3", lease=lease.ID, ignore_lease=True))
    assert (both.value.code(), both.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                         "etcdserver: lease is provided")
    on_lease = rpc_pb2.Compare(key=b"k", target=rpc_pb2.Compare.LEASE, result=rpc_pb2.Compare.EQUAL,
                               lease=lease.ID)
    txn = await etcd.kv.Txn(rpc_pb2.TxnRequest(compare=[on_lease], success=[
        rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=b"k", value=b"4"))]))  # a put without lease detaches
    assert txn.succeeded
    assert not (await etcd.kv.Txn(rpc_pb2.TxnRequest(compare=[on_lease]))).succeeded
    assert (await etcd.kv.Range(rpc_pb2.RangeRequest(key=b"k"))).kvs[0].lease == 0
