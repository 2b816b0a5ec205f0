"""The raft transport a node's configuration asks for: its frame limit (following
max_batch_bytes), peer TLS, and who may connect. One place, so the runtime and the tests
build the same transport from a NodeConfig."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from app.config import NodeConfig
from app.tls import ReloadableContexts
from app.transport import PeerSecurity, RaftTransport, transport_config_for
from raft.messages import Envelope


def peer_security_for(config: NodeConfig) -> PeerSecurity:
    files = config.peer_tls
    return PeerSecurity(tls=ReloadableContexts(files) if files is not None else None,
                        allowed_observers=config.allowed_observers)


def raft_transport_for(config: NodeConfig, on_message: Callable[[Envelope], None]) -> RaftTransport:
    return RaftTransport(
        config.node_id, config.cluster_id, config.cluster_secret.encode(), config.listen_raft.host,
        config.listen_raft.port, {i: (a.host, a.port) for i, a in config.peers.items()}, on_message,
        dataclasses.replace(transport_config_for(config.max_batch_bytes),
                            max_handshaking_connections=config.max_raft_handshakes),
        peer_security_for(config), frozenset(config.voters),
    )
