"""TLS contexts for the raft port (mutual TLS between nodes) and the HTTP API, the identities
certificates carry, and their reload on SIGHUP.

Identity. A node's certificate names its node id as ``node-<id>``, in the subject's common name
or in a DNS subjectAltName (``metakv certs`` writes both); a certificate naming no id, or two
different ids, identifies nobody. A client certificate's names (CN, DNS and email SANs) are
matched against the token file's token names (docs/security.md), as etcd's
``--client-cert-auth`` maps a certificate's CN to a user.

Reload. ``ReloadableContexts.reload`` builds new contexts from the same files; a file that no
longer loads is refused with a log line and the contexts in force stay. The raft transport asks
for the current context on every connection. uvicorn keeps the one context it started with, so
the HTTP context is reloaded in place: the certificate and key are replaced, the CA file's
certificates are added to those trusted (a CA removed from the file stays trusted until a
restart, which is what a CA rotation needs anyway).
"""

from __future__ import annotations

import logging
import re
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("metakv.tls")

NODE_NAME_RE = re.compile(r"node-(\d{1,10})")


class TlsFileError(ValueError):
    """A certificate, key or CA file cannot be used; the message is one line naming it."""


def node_name(node_id: int) -> str:
    """The name a node's certificate carries (CN and DNS SAN)."""
    return f"node-{node_id}"


def certificate_names(peer_cert: dict[str, Any] | None) -> list[str]:
    """The subject's common names, then the DNS and email subjectAltNames, of a certificate
    as ``ssl.SSLObject.getpeercert()`` returns it (a verified one: unverified certificates
    come back as an empty dict)."""
    if not peer_cert:
        return []
    names: list[str] = []
    for rdn in peer_cert.get("subject", ()):
        for attribute, value in rdn:
            if attribute == "commonName":
                names.append(str(value))
    for kind, value in peer_cert.get("subjectAltName", ()):
        if kind in ("DNS", "email"):
            names.append(str(value))
    return names


def node_id_of(peer_cert: dict[str, Any] | None) -> int | None:
    """The node id a peer's certificate names, or None when it names none or several."""
    ids = {int(match.group(1)) for name in certificate_names(peer_cert)
           if (match := NODE_NAME_RE.fullmatch(name))}
    return ids.pop() if len(ids) == 1 else None


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """One certificate chain, its key, and the CA that verifies the other side (None: the
    other side is not asked for a certificate)."""

    cert_file: Path
    key_file: Path
    ca_file: Path | None = None


def _load_chain(context: ssl.SSLContext, files: TlsFiles) -> None:
    try:
        context.load_cert_chain(files.cert_file, files.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise TlsFileError(f"certificate {str(files.cert_file)!r} with key {str(files.key_file)!r}: "
                           f"{_ssl_reason(exc)}") from None
    if files.ca_file is not None:
        try:
            context.load_verify_locations(cafile=files.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise TlsFileError(f"CA file {str(files.ca_file)!r}: {_ssl_reason(exc)}") from None


def _ssl_reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc)


def peer_server_context(files: TlsFiles) -> ssl.SSLContext:
    """The raft listener's side: present our certificate, require one from the cluster's CA."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(context, files)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def peer_client_context(files: TlsFiles) -> ssl.SSLContext:
    """The dialling side: present our certificate, require the peer's from the cluster's CA.
    Host names are not checked: the transport checks the node id the certificate names
    against the node it dialled, which is what a cluster member is."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = False
    _load_chain(context, files)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def http_server_context(files: TlsFiles) -> ssl.SSLContext:
    """The HTTP listener: with a CA file every client must present a certificate from it."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(context, files)
    context.verify_mode = ssl.CERT_REQUIRED if files.ca_file is not None else ssl.CERT_NONE
    return context


class ReloadableContexts:
    """The raft transport's two contexts, rebuilt as a pair by ``reload``."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self.server = peer_server_context(files)
        self.client = peer_client_context(files)

    def reload(self) -> bool:
        try:
            server, client = peer_server_context(self.files), peer_client_context(self.files)
        except TlsFileError as exc:
            log.error("tls: peer certificates not reloaded, keeping the ones loaded before: %s", exc)
            return False
        self.server, self.client = server, client
        log.warning("tls: reloaded the peer certificate %s", self.files.cert_file)
        return True


def reload_in_place(context: ssl.SSLContext, files: TlsFiles) -> bool:
    """Load ``files`` into a context already serving (uvicorn's); on error keep what it has."""
    try:
        http_server_context(files)  # validate first: a half-applied reload would be worse
        _load_chain(context, files)
    except TlsFileError as exc:
        log.error("tls: HTTP certificate not reloaded, keeping the one loaded before: %s", exc)
        return False
    log.warning("tls: reloaded the HTTP certificate %s", files.cert_file)
    return True


def describe_tls_failure(exc: BaseException) -> str | None:
    """A TLS handshake failure in a few words (None: not a TLS failure)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS: the certificate was refused: {exc.verify_message or exc.reason}"
    if isinstance(exc, ssl.SSLError):
        reason = exc.reason or str(exc)
        if reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE":
            return "TLS: the peer sent no certificate"
        if reason == "WRONG_VERSION_NUMBER":
            return "TLS handshake failed: the peer does not speak TLS (WRONG_VERSION_NUMBER)"
        return f"TLS handshake failed: {reason}"
    return None
