"""HTTPS connections' client certificates, handed to the app in the ASGI scope.

uvicorn puts nothing about TLS into the scope, so this protocol (used when the node serves
HTTPS) reads the verified client certificate once per connection and adds its names to every
request's scope as ``scope["extensions"]["tls"]["client_cert_names"]``; the auth middleware
(app/http/auth.py) maps them to a token of the token file."""

from __future__ import annotations

import asyncio

from app.http.uvicorn_protocol import CoalescingHttpToolsProtocol
from app.tls import certificate_names

TLS_EXTENSION = "tls"


def client_cert_names(scope: dict) -> tuple[str, ...]:
    """The names of the request's verified client certificate (none over plain HTTP)."""
    tls = scope.get("extensions", {}).get(TLS_EXTENSION) or {}
    return tuple(tls.get("client_cert_names", ()))


class ClientCertHttpToolsProtocol(CoalescingHttpToolsProtocol):
    """``uvicorn.Config(http=...)`` for HTTPS: the coalescing protocol plus the client
    certificate's names in the scope."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        ssl_object = transport.get_extra_info("ssl_object")
        peer_cert = ssl_object.getpeercert() if ssl_object is not None else None
        self._client_cert_names = tuple(certificate_names(peer_cert))
        super().connection_made(transport)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {TLS_EXTENSION: {"client_cert_names": self._client_cert_names}}
