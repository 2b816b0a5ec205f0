"""What SIGHUP reloads on a running node: the token file (app/auth.py) and the HTTP and peer
certificates (app/tls.py). Each keeps what it had when its new files do not load."""

from __future__ import annotations

import logging
import ssl
from typing import Any

from app.config import NodeConfig
from app.tls import reload_in_place

log = logging.getLogger("metakv")


def reload_on_sighup(config: NodeConfig, runtime: Any, http_context: ssl.SSLContext | None) -> None:
    """``runtime`` is the NodeRuntime (its auth_tokens and, once started, its transport)."""
    reloaded = False
    if runtime.auth_tokens is not None:
        runtime.auth_tokens.reload()
        reloaded = True
    http_files = config.http_tls
    if http_context is not None and http_files is not None:
        reload_in_place(http_context, http_files)
        reloaded = True
    transport = getattr(runtime, "transport", None)
    peer_tls = transport.security.tls if transport is not None else None
    if peer_tls is not None:
        peer_tls.reload()
        reloaded = True
    if not reloaded:
        # SIGHUP's default action would kill the node: people send it expecting a reload.
        log.warning("SIGHUP: no auth file configured, nothing to reload (and no TLS certificates)")
