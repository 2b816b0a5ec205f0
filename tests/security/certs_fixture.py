"""Certificates for the security tests, made once per session with app/certs.py: the
cluster's CA and node certificates, a second CA, an expired node certificate, client
certificates, and a node certificate naming another node."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from app.certs import issue, make_ca, write_pair
from app.tls import TlsFiles, node_name

HOSTS = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class CertSet:
    directory: Path

    @property
    def ca(self) -> Path:
        return self.directory / "ca.crt"

    def node(self, node_id: int, kind: str = "") -> TlsFiles:
        """``kind``: "" (good), "other-ca", "expired". Every kind trusts the cluster's CA
        (it is no secret): only the certificate it presents differs."""
        stem = node_name(node_id) + (f"-{kind}" if kind else "")
        return TlsFiles(self.directory / f"{stem}.crt", self.directory / f"{stem}.key", self.ca)

    def client(self, name: str) -> tuple[Path, Path]:
        return self.directory / f"client-{name}.crt", self.directory / f"client-{name}.key"


def make_test_certs(directory: Path, node_ids: range, clients: tuple[str, ...] = ("root",)) -> CertSet:
    directory.mkdir(parents=True, exist_ok=True)
    ca, other_ca = make_ca(), make_ca("someone else's CA")
    write_pair(directory, "ca", ca)
    write_pair(directory, "other-ca", other_ca)
    for node_id in node_ids:
        name = node_name(node_id)
        write_pair(directory, name, issue(ca, name, HOSTS))
        write_pair(directory, f"{name}-other-ca", issue(other_ca, name, HOSTS))
        long_ago = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=30)
        write_pair(directory, f"{name}-expired", issue(ca, name, HOSTS, days=1, not_before=long_ago))
    for client in clients:
        write_pair(directory, f"client-{client}", issue(ca, client, server=False))
    return CertSet(directory)
