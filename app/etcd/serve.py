"""A node's etcd front ends, started and stopped together on one mapping
(app/etcd/mapping.py): gRPC and the JSON gateway on the one etcd port behind the sniffing
front (app/etcd/front.py), or, with --listen-etcd-gateway, gRPC alone on the etcd port
(grpc's own listener, no relay) and the gateway on its own port."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import ssl
import tempfile
from pathlib import Path

from app.auth import AuthTokens
from app.config import NodeConfig
from app.etcd.access import EtcdAuth
from app.etcd.callers import Callers
from app.etcd.front import ALPN_PROTOCOLS, EtcdFront
from app.etcd.gateway import EtcdGateway
from app.etcd.grpc_server import EtcdGrpcServer
from app.etcd.mapping import EtcdMapping
from app.service import KVService
from app.tls import TlsFiles, http_server_context, reload_in_place

GRPC_SOCKET = "etcd-grpc.sock"  # the gRPC server behind the front, in a directory only this user reads
SOCKET_PATH_MAX = 100  # a unix socket address holds 107 bytes and a NUL


def _leader_https(config: NodeConfig) -> ssl.SSLContext | None:
    """How a follower reaches the leader's HTTPS API to forward etcd calls: trusting the
    system's CAs and the cluster's (peer and client CA files), with this node's certificate
    for a leader that requires one."""
    files = config.http_tls
    if files is None:
        return None
    context = ssl.create_default_context()
    for ca_file in {config.peer_tls_ca_file, config.tls_client_ca_file} - {None}:
        context.load_verify_locations(cafile=ca_file)
    context.load_cert_chain(files.cert_file, files.key_file)
    return context


def _front_context(tls: TlsFiles | None) -> ssl.SSLContext | None:
    """The HTTP API's TLS settings, offering h2 (gRPC) and http/1.1 (the gateway) by ALPN."""
    if tls is None:
        return None
    context = http_server_context(tls)
    context.set_alpn_protocols(ALPN_PROTOCOLS)
    return context


class EtcdApi:
    """``host:port`` serves both APIs; with ``gateway`` (host, port) the gateway moves there
    and ``host:port`` serves gRPC alone. With ``tls`` (the node's HTTPS files) every etcd
    listener speaks TLS, and asks for a client certificate when the files name a CA. With
    ``tokens`` every call needs a token granting what it does (app/etcd/access.py)."""

    def __init__(self, mapping: EtcdMapping, host: str, port: int, gateway: tuple[str, int] | None = None,
                 tls: TlsFiles | None = None, tokens: AuthTokens | None = None, data_dir: Path | None = None) -> None:
        self.mapping = mapping
        self.front: EtcdFront | None = None
        self.tls = tls
        self._temp_dir: str | None = None  # made for the gRPC socket (removed by stop)
        self._socket: str | None = None
        auth = None if tokens is None else EtcdAuth(tokens)
        if gateway is None:
            grpc_path = self._socket = self._socket_path(data_dir)
            self.gateway = EtcdGateway(mapping, auth=auth)
            self.front = EtcdFront(host, port, grpc_path, self.gateway.protocol, _front_context(tls))
            self.grpc = EtcdGrpcServer(mapping, unix_path=grpc_path, callers=Callers(self.front.callers), auth=auth)
        else:
            self.grpc = EtcdGrpcServer(mapping, host, port, tls=tls, auth=auth)
            self.gateway = EtcdGateway(mapping, *gateway, ssl_context=None if tls is None else http_server_context(tls),
                                       auth=auth)

    @classmethod
    def of_node(cls, service: KVService, config: NodeConfig, tokens: AuthTokens | None = None) -> EtcdApi:
        """``tokens``: the node's token file (auth on), the HTTP API's own object, so SIGHUP
        reloads both."""
        address = config.listen_etcd
        assert address is not None
        tls = config.http_tls
        # MemberList knows this node's own etcd URL only (the others' are not in its config).
        urls: dict[int, list[str]] = {node_id: [] for node_id in config.voters}
        urls[config.node_id] = [f"{'https' if tls else 'http'}://{address.url_host}:{address.port}"]
        gateway = config.listen_etcd_gateway
        mapping = EtcdMapping(service, config.cluster_id, urls)
        mapping.link.https = _leader_https(config)
        return cls(mapping, address.host, address.port, None if gateway is None else (gateway.host, gateway.port),
                   tls, tokens, config.data_dir)

    def _socket_path(self, data_dir: Path | None) -> str:
        """The gRPC server's unix socket: in the node's data directory (0700, no leftovers
        after a SIGKILL) when the path fits a socket address, else in a private temp dir."""
        path = os.path.abspath(os.path.join(data_dir, GRPC_SOCKET)) if data_dir is not None else None
        if path is not None and len(path) <= SOCKET_PATH_MAX:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a killed node's
            return path
        self._temp_dir = tempfile.mkdtemp(prefix="metakv-etcd-")  # mode 0700
        return os.path.join(self._temp_dir, GRPC_SOCKET)

    @property
    def port(self) -> int:
        """The etcd port (bound: a port 0 asked for is known once started)."""
        return self.front.port if self.front is not None else self.grpc.port

    async def start(self) -> None:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per forwarded call otherwise
        await self.grpc.start()
        await self.gateway.start()
        if self.front is not None:
            await self.front.start()
            logging.getLogger(__name__).info("etcd v3 API (gRPC and JSON gateway) on %s:%d",
                                             self.front.host, self.front.port)

    def reload_tls(self) -> None:
        """SIGHUP: the one port's certificate and CA reloaded in place as the HTTP API's are
        (the two-port layout keeps the ones it started with until a restart)."""
        if self.tls is not None and self.front is not None and self.front.ssl_context is not None:
            reload_in_place(self.front.ssl_context, self.tls)

    async def stop(self) -> None:
        if self.front is not None:
            await self.front.stop()
        await self.gateway.stop()
        await self.grpc.stop()
        await self.mapping.close()
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
        elif self._socket is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._socket)
