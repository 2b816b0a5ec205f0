"""A node's etcd front ends, started and stopped together: the gRPC listener and, when
configured, the JSON gateway, both on one mapping (app/etcd/mapping.py)."""

from __future__ import annotations

import logging

from app.config import NodeConfig
from app.etcd.gateway import EtcdGateway
from app.etcd.grpc_server import EtcdGrpcServer
from app.etcd.mapping import EtcdMapping
from app.service import KVService


class EtcdApi:
    def __init__(self, service: KVService, config: NodeConfig) -> None:
        address = config.listen_etcd
        assert address is not None
        # MemberList knows this node's own etcd URL only (the others' are not in its config).
        urls: dict[int, list[str]] = {node_id: [] for node_id in config.voters}
        urls[config.node_id] = [f"http://{address.url_host}:{address.port}"]
        self.mapping = EtcdMapping(service, config.cluster_id, urls)
        self.grpc = EtcdGrpcServer(self.mapping, address.host, address.port)
        gateway = config.listen_etcd_gateway
        self.gateway = None if gateway is None else EtcdGateway(self.mapping, gateway.host, gateway.port)

    async def start(self) -> None:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per forwarded call otherwise
        await self.grpc.start()
        if self.gateway is not None:
            await self.gateway.start()

    async def stop(self) -> None:
        if self.gateway is not None:
            await self.gateway.stop()
        await self.grpc.stop()
        await self.mapping.close()
