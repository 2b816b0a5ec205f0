"""Serve an ASGI app with uvicorn on a loopback socket bound to port 0, in a background thread.

Used where a test needs a real HTTP server (the schemathesis CLI run). The socket is bound
by the test itself, so the port is known before the server starts and no other process can
take it in between.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

SERVER_START_TIMEOUT_S = 30
SERVER_STOP_TIMEOUT_S = 30


@contextmanager
def serve_in_thread(app: Any, http: Any = "auto") -> Iterator[str]:
    """Yield the base URL of ``app`` served on 127.0.0.1; stop the server on exit.
    ``http``: uvicorn's protocol (``CoalescingHttpToolsProtocol``, as ``metakv serve`` runs)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    config = uvicorn.Config(app, http=http, log_level="warning", lifespan="off", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[listener])), daemon=True)
    thread.start()
    try:
        deadline_s = time.monotonic() + SERVER_START_TIMEOUT_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline_s:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(SERVER_STOP_TIMEOUT_S)
        listener.close()
