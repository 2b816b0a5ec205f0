"""``metakv certs``: a cluster CA and the certificates ``cluster up --tls`` (and a real
deployment's first try) needs, written as PEM files.

    metakv certs --dir ./certs --nodes 1,2,3,4 [--clients root] [--hosts 127.0.0.1,localhost] [--days 365]

writes ca.crt/ca.key, node-<id>.crt/.key per node (CN and DNS name node-<id>, plus every
--hosts name and address, usable as server and as client: a node dials its peers with the same
certificate) and client-<name>.crt/.key per client (CN <name>: a token of that name in the
token file is what the certificate stands for). Keys are ECDSA P-256, written 0600. Files that
exist are refused, never overwritten: a CA key is not something to lose by a repeated command.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from app.tls import NODE_NAME_RE, node_name

DEFAULT_DAYS = 365
DEFAULT_HOSTS = ("127.0.0.1", "localhost")


class CertsError(ValueError):
    """A certs request that cannot be carried out; the message is one line."""


@dataclass(frozen=True)
class Issued:
    """A certificate and its private key."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        return self.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())


def _validity(days: int, not_before: datetime.datetime | None) -> tuple[datetime.datetime, datetime.datetime]:
    start = not_before or datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    return start, start + datetime.timedelta(days=days)


def make_ca(common_name: str = "metakv cluster CA", days: int = DEFAULT_DAYS) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    start, end = _validity(days, None)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return Issued(cert, key)


def issue(ca: Issued, common_name: str, hosts: Sequence[str] = (), *, server: bool = True,
          days: int = DEFAULT_DAYS, not_before: datetime.datetime | None = None) -> Issued:
    """A certificate for ``common_name`` signed by ``ca``; ``hosts`` become DNS or IP SANs
    (``common_name`` is a DNS SAN too). ``server``: usable by a server and a client (a node),
    else by a client only."""
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName(common_name)] if "@" not in common_name else []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if server else [])
    start, end = _validity(days, not_before)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
               .issuer_name(ca.cert.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return Issued(builder.sign(ca.key, hashes.SHA256()), key)


def write_pair(directory: Path, stem: str, issued: Issued) -> tuple[Path, Path]:
    """``<stem>.crt`` and ``<stem>.key`` (0600) in ``directory``; refuses to overwrite."""
    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
    for path in (cert_path, key_path):
        if path.exists():
            raise CertsError(f"{path} exists; remove it or pick another --dir (certs never overwrites)")
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as key_file:
        key_file.write(issued.key_pem())
    cert_path.write_bytes(issued.cert_pem())
    return cert_path, key_path


def load_ca(directory: Path) -> Issued | None:
    """The CA already in ``directory`` (certs adds nodes to an existing CA), or None."""
    cert_path, key_path = directory / "ca.crt", directory / "ca.key"
    if not cert_path.exists() or not key_path.exists():
        return None
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertsError(f"{key_path}: not an ECDSA key written by metakv certs")
    return Issued(x509.load_pem_x509_certificate(cert_path.read_bytes()), key)


def check_client_name(name: str) -> None:
    """A client certificate's name must not be a node's (the raft port would take it for that
    node: it is issued by the cluster's CA for client use) nor anything but a file name."""
    if NODE_NAME_RE.fullmatch(name):
        raise CertsError(f"--clients: a certificate named {name!r} would connect to the raft port as node "
                         f"{name.removeprefix('node-')}; pick a name that is not node-<id>")
    if "/" in name or "\\" in name or not name.isprintable():
        raise CertsError(f"--clients: {name!r} is not usable in a file name (client-<name>.crt)")


def make_certs(directory: Path, node_ids: Sequence[int], clients: Sequence[str] = (),
               hosts: Sequence[str] = DEFAULT_HOSTS, days: int = DEFAULT_DAYS) -> list[Path]:
    """Everything ``metakv certs`` writes; returns the files written."""
    for client in clients:
        check_client_name(client)
    directory.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    ca = load_ca(directory)
    if ca is None:
        ca = make_ca(days=days)
        written += write_pair(directory, "ca", ca)
    for node_id in node_ids:
        written += write_pair(directory, node_name(node_id), issue(ca, node_name(node_id), hosts, days=days))
    for client in clients:
        written += write_pair(directory, f"client-{client}", issue(ca, client, server=False, days=days))
    return written
