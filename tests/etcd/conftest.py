"""An etcd gRPC listener on an in-process node (tests/http/service_double.py) and stubs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from app.etcd.grpc_server import EtcdGrpcServer
from app.etcd.mapping import EtcdMapping
from app.etcd.protos import rpc_pb2_grpc
from tests.http.conftest import anyio_backend, service  # noqa: F401  (the same node as the HTTP tests)
from tests.http.service_double import InProcessService


@dataclass
class Stubs:
    kv: rpc_pb2_grpc.KVStub
    watch: rpc_pb2_grpc.WatchStub
    maintenance: rpc_pb2_grpc.MaintenanceStub
    cluster: rpc_pb2_grpc.ClusterStub
    lease: rpc_pb2_grpc.LeaseStub


@pytest.fixture
async def etcd(service: InProcessService) -> AsyncIterator[Stubs]:  # noqa: F811  (the fixture)
    mapping = EtcdMapping(service, "test-cluster", {1: ["http://127.0.0.1:1"]})
    server = EtcdGrpcServer(mapping, "127.0.0.1", 0)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield Stubs(rpc_pb2_grpc.KVStub(channel), rpc_pb2_grpc.WatchStub(channel),
                    rpc_pb2_grpc.MaintenanceStub(channel), rpc_pb2_grpc.ClusterStub(channel),
                    rpc_pb2_grpc.LeaseStub(channel))
    finally:
        await channel.close()
        await server.stop()
        await mapping.close()
