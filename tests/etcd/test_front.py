"""One etcd port for gRPC and the JSON gateway (app/etcd/front.py), against an in-process
node: both APIs on the same port, junk closes only its own connection, and the gRPC server
behind the front answers only what came through it."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest

from app.etcd.mapping import EtcdMapping
from app.etcd.protos import rpc_pb2, rpc_pb2_grpc
from app.etcd.serve import EtcdApi
from tests.http.service_double import InProcessService

pytestmark = pytest.mark.anyio
WAIT_S = 10


@pytest.fixture
async def one_port(service: InProcessService) -> AsyncIterator[EtcdApi]:
    api = EtcdApi(EtcdMapping(service, "test-cluster", {1: []}), "127.0.0.1", 0)
    await api.start()
    try:
        yield api
    finally:
        await api.stop()


async def test_grpc_and_the_gateway_share_the_port(one_port: EtcdApi) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{one_port.port}") as channel:
        put = await rpc_pb2_grpc.KVStub(channel).Put(rpc_pb2.PutRequest(key=b"k", value=b"grpc"), timeout=WAIT_S)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{one_port.port}", timeout=WAIT_S) as http:
        got = (await http.post("/v3/kv/range", json={"key": base64.b64encode(b"k").decode()})).json()
        assert (await http.get("/version")).json()["etcdserver"] == "3.4.0"
    assert base64.b64decode(got["kvs"][0]["value"]) == b"grpc"
    assert got["header"]["revision"] == str(put.header.revision)


async def test_junk_closes_its_connection_only(one_port: EtcdApi) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{one_port.port}") as channel:
        kv = rpc_pb2_grpc.KVStub(channel)
        await kv.Put(rpc_pb2.PutRequest(key=b"k", value=b"v"), timeout=WAIT_S)  # a connection open throughout
        for junk in (b"\x16\x03\x01\x00\xff\xff\r\n\r\n", b"PRI * HTTP/1.1 nonsense\r\n\r\n", b"GET\x00 /\r\n\r\n"):
            reader, writer = await asyncio.open_connection("127.0.0.1", one_port.port)
            writer.write(junk)
            answer = await asyncio.wait_for(reader.read(), WAIT_S)  # read to EOF: the front closed it
            writer.close()
            assert answer == b"" or answer.startswith(b"HTTP/1.1 400")
        got = await kv.Range(rpc_pb2.RangeRequest(key=b"k"), timeout=WAIT_S)
    assert got.kvs[0].value == b"v"


async def test_a_half_preface_waits_for_the_rest(one_port: EtcdApi) -> None:
    """The preface split over two writes is still gRPC (the sniffer waits for 24 bytes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", one_port.port)
    writer.write(b"PRI * HTTP/2")
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.write(b".0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000"))  # an empty SETTINGS frame
    first = await asyncio.wait_for(reader.read(9), WAIT_S)
    writer.close()
    assert first[3] == 0x04  # the server's SETTINGS frame: HTTP/2, so gRPC answered


async def test_the_grpc_server_behind_the_front_answers_only_relayed_calls(one_port: EtcdApi) -> None:
    """The private unix socket, reached around the front, refuses (its TLS and callers are the front's)."""
    assert one_port.grpc.unix_path is not None
    async with grpc.aio.insecure_channel(f"unix:{one_port.grpc.unix_path}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await rpc_pb2_grpc.KVStub(channel).Range(rpc_pb2.RangeRequest(key=b"k"), timeout=WAIT_S)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_authenticate_without_a_token_file_is_etcds_not_enabled(one_port: EtcdApi) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{one_port.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await rpc_pb2_grpc.AuthStub(channel).Authenticate(rpc_pb2.AuthenticateRequest(name="a", password="b"),
                                                              timeout=WAIT_S)
    assert (refused.value.code(), refused.value.details()) == (
        grpc.StatusCode.FAILED_PRECONDITION, "etcdserver: authentication is not enabled")
