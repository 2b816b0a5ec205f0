"""An event loop whose TLS servers bound the TLS handshake (docs/security.md "Connection limits").

uvicorn creates its HTTPS server without ``ssl_handshake_timeout``, so asyncio's and uvloop's
60 s default applied, and the HTTP protocol (its connection caps, its header clock) meets a
connection only once TLS is done: a client that never sent a ClientHello held a descriptor
for a minute outside every HTTP limit. The node's loop passes the header timeout instead, so
such a connection is closed as soon as a half-sent request would be.
"""

from __future__ import annotations

import asyncio
from typing import Any


def bounded_tls_handshake_loop(base: type[asyncio.AbstractEventLoop],
                               timeout_s: float) -> type[asyncio.AbstractEventLoop]:
    """A subclass of the event loop class ``base`` whose ``create_server`` with ``ssl`` gives
    the TLS handshake ``timeout_s`` unless the caller chose a timeout itself."""

    class BoundedTlsHandshakeLoop(base):  # type: ignore[valid-type,misc]
        async def create_server(self, *args: Any, **kwargs: Any) -> asyncio.AbstractServer:
            if kwargs.get("ssl") is not None and kwargs.get("ssl_handshake_timeout") is None:
                kwargs["ssl_handshake_timeout"] = timeout_s
            return await super().create_server(*args, **kwargs)

    return BoundedTlsHandshakeLoop
