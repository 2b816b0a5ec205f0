"""Who makes a gRPC call on the etcd port: the client's address and the names of its verified
TLS certificate, read from the front's relay records (app/etcd/front.py) when gRPC sits
behind the one-port front, else from grpc's own view of the connection."""

from __future__ import annotations

import grpc

from app.etcd.errors import EtcdError
from app.etcd.front import Caller

NOT_RELAYED = "metakv: connect through the etcd port"


def _address(peer: str) -> tuple[str, int] | None:
    """grpc's ``ipv4:1.2.3.4:5`` / ``ipv6:[::1]:5`` as (host, port); None for other kinds."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.rpartition(":")
    return (host.strip("[]"), int(port)) if port.isdigit() else None


class Callers:
    """``relayed``: the front's records (gRPC behind the front); None: gRPC on its own port."""

    def __init__(self, relayed: dict[str, Caller] | None) -> None:
        self.relayed = relayed

    def of(self, context: grpc.aio.ServicerContext) -> Caller:
        peer = context.peer()
        if self.relayed is None:
            auth = context.auth_context()
            names = [value.decode("utf-8", "replace") for name in ("x509_common_name", "x509_subject_alternative_name")
                     for value in auth.get(name, ())] if auth.get("transport_security_type") == [b"ssl"] else []
            verified = bool(auth.get("x509_pem_cert")) and bool(names)
            return Caller(_address(peer), tuple(names) if verified else ())
        caller = self.relayed.get(peer)
        if caller is None:  # straight to the private socket, around the front's TLS
            raise EtcdError(grpc.StatusCode.PERMISSION_DENIED, NOT_RELAYED)
        return caller
