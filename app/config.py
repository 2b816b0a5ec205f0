"""Node configuration: one typed value built from flags, METAKV_* environment variables and an
optional TOML file, in that order of precedence.

Why three sources: the same container image serves every node of a compose cluster (so every
setting must come from the environment), operators keep long-lived settings in a file, and a
person at a terminal overrides either with a flag. Every problem is a ``ConfigError`` whose
message is one line; the CLI prints it and exits 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import os
import re
import socket
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.auth import AuthFileError, AuthPolicy, load_auth_policy
from app.tls import TlsFileError, TlsFiles, http_server_context, peer_server_context
from app.toml_files import TomlFileError, read_toml
from app.ui.modes import UI_MODES, UiMode
from raft.node import RaftConfig

DEFAULT_CLUSTER_ID = "metakv-local"
# The default secret is for a local, loopback-only cluster; any real deployment sets
# METAKV_CLUSTER_SECRET (docs/api.md, serve). Nodes with different secrets refuse each other.
DEFAULT_CLUSTER_SECRET = "metakv-local-insecure-secret"
ENV_PREFIX = "METAKV_"
# What one PUT adds to its value in a log batch, at most: the key (up to 1024 bytes) in the op
# and in up to three compares (If-Match with weak tags only is two, If-None-Match one more),
# the content type (up to 256 bytes), msgpack framing, and the raft record and batch headers:
# ~4.4 KiB; rounded up to 8 KiB. max_batch_bytes below max_value_bytes + this would let a PUT
# the HTTP layer accepts fail with 503 on every retry (the proposal can never fit a batch),
# so the config refuses it.
RECORD_FRAMING_MAX_BYTES = 8192


_RAFT_DEFAULTS = {field.name: field.default for field in dataclasses.fields(RaftConfig)}


class ConfigError(ValueError):
    """A setting is missing or invalid; the message is one line naming the setting."""


@dataclass(frozen=True, slots=True)
class HostPort:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.url_host}:{self.port}"

    @property
    def url_host(self) -> str:
        """The host as it goes into a URL or HOST:PORT: an IPv6 address in brackets."""
        return f"[{self.host}]" if ":" in self.host else self.host


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """Everything one ``metakv serve`` process needs. Durations in ms, sizes in bytes."""

    node_id: int
    data_dir: Path
    listen_http: HostPort
    listen_raft: HostPort
    voters: dict[int, HostPort]
    advertise_http: str
    observer: bool = False
    # KIP-853: format an empty log with this node as the only voter (app/runtime_voters.py)
    standalone: bool = False
    # Join as an observer of the voters any of these nodes' /v1/status names (app/cli_voters.py)
    bootstrap_servers: tuple[str, ...] = ()
    cluster_id: str = DEFAULT_CLUSTER_ID
    cluster_secret: str = DEFAULT_CLUSTER_SECRET
    # The core's settings default to the core's own defaults (one place to change them).
    election_timeout_ms: int = _RAFT_DEFAULTS["election_timeout_ms"]
    fetch_timeout_ms: int = _RAFT_DEFAULTS["fetch_timeout_ms"]
    election_backoff_max_ms: int = _RAFT_DEFAULTS["election_backoff_max_ms"]
    fetch_max_wait_ms: int = _RAFT_DEFAULTS["fetch_max_wait_ms"]
    request_timeout_ms: int = _RAFT_DEFAULTS["request_timeout_ms"]
    append_linger_ms: int = _RAFT_DEFAULTS["append_linger_ms"]
    max_batch_bytes: int = _RAFT_DEFAULTS["max_batch_bytes"]
    max_pending_records: int = _RAFT_DEFAULTS["max_pending_records"]
    segment_bytes: int = 64 * 1024 * 1024
    max_value_bytes: int = 1024 * 1024
    commit_timeout_ms: int = 5000
    shutdown_grace_ms: int = 5000
    log_level: str = "info"
    # Compaction (docs/compaction.md). tombstone_retention_records must be equal on every
    # node: it is part of what makes cleaned prefixes byte-identical.
    cleaner_interval_ms: int = 10_000
    cleaner_min_dirty_ratio: float = 0.5
    # Records stay uncleaned (and their history readable: at_version, watch since) at least
    # this long after the leader appended them (Kafka's min.compaction.lag.ms).
    min_compaction_lag_ms: int = 60_000
    tombstone_retention_records: int = 0
    snapshot_every_records: int = 100_000
    # HTTP auth (app/auth.py, docs/http.md "Auth"): off unless a token file is given. The
    # policy is read and validated with the rest of the config, so a bad file exits 2.
    auth_file: Path | None = None
    listen_etcd: HostPort | None = None  # etcd's v3 gRPC API (docs/etcd.md); None: off
    listen_etcd_gateway: HostPort | None = None  # etcd's v3 JSON gateway; needs listen_etcd
    auth_policy: AuthPolicy | None = None
    ui: UiMode = "on"  # the dashboard at /ui (docs/ui.md)
    # --- security (docs/security.md): TLS for HTTP and raft, who may connect, --insecure.
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_client_ca_file: Path | None = None
    peer_tls_cert_file: Path | None = None
    peer_tls_key_file: Path | None = None
    peer_tls_ca_file: Path | None = None
    allowed_observers: frozenset[int] = frozenset()
    insecure: bool = False
    # --- end of security
    # --- storage quota (docs/security.md): past it the leader refuses writes that add data.
    quota_bytes: int = 0  # state.db + log bytes; 0 = no quota
    # --- leases (docs/leases.md): the longest TTL a grant may ask for.
    max_lease_ttl_s: int = 86_400
    # --- HTTP abuse limits (docs/security.md "Connection limits")
    # Literals, as app/http/settings.py's defaults: importing app.http here would load FastAPI
    # for every CLI command.
    max_header_bytes: int = 64 * 1024  # request line + headers, else 431
    header_timeout_ms: int = 10_000  # headers not complete by then: 408, closed
    write_stall_timeout_ms: int = 30_000  # a client that reads nothing this long is disconnected
    max_connections: int = 10_000  # HTTP connections per node, else 503 (kept below the fd limit)
    max_connections_per_client: int = 1000  # HTTP connections per client address, else 503
    max_watchers: int = 10_000  # open watches per node, else 429
    max_watchers_per_token: int = 1000  # open watches per token per node, else 429
    max_answer_bytes: int = 4 * 1024 * 1024  # values per list page or watch answer; past it the page ends
    max_watch_timeout_ms: int = 300_000  # longest long-poll, and SSE stream lifetime (idle or not)
    # --- end of HTTP abuse limits
    max_raft_handshakes: int = 64  # raft connections still in the handshake; past it closed at accept

    @property
    def peers(self) -> dict[int, HostPort]:
        """Raft addresses of the voters other than this node (whom the transport dials)."""
        return {node_id: addr for node_id, addr in self.voters.items() if node_id != self.node_id}

    @property
    def http_tls(self) -> TlsFiles | None:
        if self.tls_cert_file is None or self.tls_key_file is None:
            return None
        return TlsFiles(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)

    @property
    def peer_tls(self) -> TlsFiles | None:
        if self.peer_tls_cert_file is None or self.peer_tls_key_file is None:
            return None
        return TlsFiles(self.peer_tls_cert_file, self.peer_tls_key_file, self.peer_tls_ca_file)


_NODE_DEFAULTS = {field.name: field.default for field in dataclasses.fields(NodeConfig)}


# ---------------------------------------------------------------------------
# Parsers: each turns a raw string (or TOML value) into a typed value or raises ConfigError.


def parse_int(name: str, raw: Any, minimum: int = 0, maximum: int = 2**62) -> int:
    # int() would truncate a TOML float (node_id = 1.7 -> 1) and raise OverflowError on inf.
    if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
        raise ConfigError(f"{name}: expected an integer, got {raw!r}")
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected an integer, got {raw!r}") from None
    if not minimum <= value <= maximum:
        raise ConfigError(f"{name}: {value} is outside [{minimum}, {maximum}]")
    return value


def parse_bool(name: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in {"1", "true", "yes", "on"}:
        return True
    if text in {"0", "false", "no", "off", ""}:
        return False
    raise ConfigError(f"{name}: expected true or false, got {raw!r}")


def parse_host_port(name: str, raw: Any, min_port: int = 0) -> HostPort:
    """``HOST:PORT`` or ``[IPV6]:PORT``; HostPort keeps the IPv6 address without brackets."""
    text = str(raw).strip()
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"{name}: expected HOST:PORT, got {text!r}")
    if host.startswith("[") or host.endswith("]"):
        if not (host.startswith("[") and host.endswith("]") and _is_ipv6(host[1:-1])):
            raise ConfigError(f"{name}: expected [IPV6-ADDRESS]:PORT, got {text!r}")
        host = host[1:-1]
    elif ":" in host:  # 1::2:80 reads as host 1::2, port 80, or host 1:: port 2 ... ambiguous
        raise ConfigError(f"{name}: an IPv6 address goes in brackets, [ADDRESS]:PORT; got {text!r}")
    elif not _HOST_NAME_RE.fullmatch(host):
        raise ConfigError(f"{name}: {host!r} is not a host name or IPv4 address")
    return HostPort(host, parse_int(f"{name} port", port, min_port, 65535))


# Host names and IPv4 addresses: RFC 3986 unreserved characters (no space, @, /, ? or #).
_HOST_NAME_RE = re.compile(r"[A-Za-z0-9._~-]+")


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def parse_voters(name: str, raw: Any) -> dict[int, HostPort]:
    """``1@127.0.0.1:9001,2@127.0.0.1:9002`` -> {1: HostPort, 2: HostPort}."""
    voters: dict[int, HostPort] = {}
    owners: dict[HostPort, int] = {}
    for item in str(raw).split(","):
        item = item.strip()
        if not item:
            continue
        node_id, sep, address = item.partition("@")
        if not sep:
            raise ConfigError(f"{name}: expected ID@HOST:PORT, got {item!r}")
        voter_id = parse_int(f"{name} id", node_id, 0, 2**31 - 1)
        if voter_id in voters:
            raise ConfigError(f"{name}: voter id {voter_id} appears twice")
        # Port 0 means "any free port" to a listener; nobody can dial it.
        address_of = voters[voter_id] = parse_host_port(name, address, min_port=1)
        if address_of in owners:
            raise ConfigError(f"{name}: voters {owners[address_of]} and {voter_id} have the same raft address {address_of}")
        owners[address_of] = voter_id
    if not voters:
        raise ConfigError(f"{name}: at least one voter is required")
    return voters


def parse_url(name: str, raw: Any) -> str:
    """An http(s) base URL with a valid host and port (a node's advertised URL, status --url):
    everything a client puts in front of a path, so nothing after the path."""
    text = str(raw).strip().rstrip("/")
    expected = f"{name}: expected an http:// or https:// URL like http://HOST:PORT, got {str(raw)!r}"
    if any(char.isspace() or not char.isprintable() for char in text):
        raise ConfigError(expected)
    try:
        parts = urllib.parse.urlsplit(text)
        port = parts.port
    except ValueError as exc:  # unbalanced brackets, a port that is not a number or out of range
        raise ConfigError(f"{expected} ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(expected)
    if "@" in parts.netloc or parts.query or parts.fragment or "?" in text or "#" in text:
        raise ConfigError(f"{expected} (no user, query or fragment)")
    host = parts.netloc.rsplit(":", 1)[0] if port is not None else parts.netloc
    if host.startswith("["):
        if not (host.endswith("]") and _is_ipv6(host[1:-1])):
            raise ConfigError(expected)
    elif not _HOST_NAME_RE.fullmatch(host):
        raise ConfigError(expected)
    if port == 0:
        raise ConfigError(f"{expected} (port 0)")
    return text


def parse_log_level(name: str, raw: Any) -> str:
    text = str(raw).strip().lower()
    if text not in {"debug", "info", "warning", "error", "critical"}:
        raise ConfigError(f"{name}: expected one of debug, info, warning, error, critical, got {raw!r}")
    return text


def parse_ratio(name: str, raw: Any) -> float:
    """A fraction in [0, 1]."""
    if isinstance(raw, bool):
        raise ConfigError(f"{name}: expected a number in [0, 1], got {raw!r}")
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected a number in [0, 1], got {raw!r}") from None
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"{name}: must be in [0, 1], got {raw!r}")
    return value


def parse_ui_mode(name: str, raw: Any) -> str:
    text = str(raw).strip().lower()
    if text not in UI_MODES:
        raise ConfigError(f"{name}: expected one of {', '.join(UI_MODES)}, got {raw!r}")
    return text


def _ms(minimum: int = 0) -> Callable[[str, Any], int]:
    return lambda name, raw: parse_int(name, raw, minimum, 24 * 3600 * 1000)


def _bytes(minimum: int) -> Callable[[str, Any], int]:
    return lambda name, raw: parse_int(name, raw, minimum, 2**40)


# Setting name -> parser. The flag is --name-with-dashes, the env var METAKV_NAME_UPPER,
# the TOML key the name itself.
SERVE_SETTINGS: dict[str, Callable[[str, Any], Any]] = {
    "node_id": lambda name, raw: parse_int(name, raw, 0, 2**31 - 1),
    "data_dir": lambda name, raw: Path(_non_empty(name, raw)),  # "" would be the current directory
    "listen_http": parse_host_port,
    "listen_raft": parse_host_port,
    "voters": parse_voters,
    "advertise_http": parse_url,
    "observer": parse_bool,
    "standalone": parse_bool,
    "bootstrap_servers": lambda name, raw: parse_url_list(name, raw),
    "cluster_id": lambda name, raw: _non_empty(name, raw),
    "cluster_secret": lambda name, raw: _non_empty(name, raw),
    "election_timeout_ms": _ms(10),
    "fetch_timeout_ms": _ms(10),
    "election_backoff_max_ms": _ms(0),
    "fetch_max_wait_ms": _ms(0),
    "request_timeout_ms": _ms(10),
    "append_linger_ms": _ms(0),
    "max_batch_bytes": _bytes(1024),
    "max_pending_records": lambda name, raw: parse_int(name, raw, 1, 10_000_000),
    "segment_bytes": _bytes(4096),
    "max_value_bytes": _bytes(1),
    "commit_timeout_ms": _ms(10),
    "shutdown_grace_ms": _ms(0),
    "log_level": parse_log_level,
    "cleaner_interval_ms": _ms(0),
    "cleaner_min_dirty_ratio": parse_ratio,
    "min_compaction_lag_ms": _ms(0),
    "tombstone_retention_records": lambda name, raw: parse_int(name, raw, 0, 2**40),
    "snapshot_every_records": lambda name, raw: parse_int(name, raw, 0, 2**40),
    "auth_file": lambda name, raw: Path(_non_empty(name, raw)),
    "listen_etcd": parse_host_port,
    "listen_etcd_gateway": parse_host_port,
    "ui": parse_ui_mode,
    # --- security
    "tls_cert_file": lambda name, raw: Path(_non_empty(name, raw)),
    "tls_key_file": lambda name, raw: Path(_non_empty(name, raw)),
    "tls_client_ca_file": lambda name, raw: Path(_non_empty(name, raw)),
    "peer_tls_cert_file": lambda name, raw: Path(_non_empty(name, raw)),
    "peer_tls_key_file": lambda name, raw: Path(_non_empty(name, raw)),
    "peer_tls_ca_file": lambda name, raw: Path(_non_empty(name, raw)),
    "allowed_observers": lambda name, raw: parse_node_ids(name, raw),
    "insecure": parse_bool,
    # --- storage quota
    "quota_bytes": _bytes(0),
    "max_lease_ttl_s": lambda name, raw: parse_int(name, raw, 1, 2**31 - 1),
    # --- HTTP abuse limits
    "max_header_bytes": _bytes(1024),
    "header_timeout_ms": _ms(100),
    "write_stall_timeout_ms": _ms(100),
    "max_connections": lambda name, raw: parse_int(name, raw, 1, 10_000_000),
    "max_connections_per_client": lambda name, raw: parse_int(name, raw, 1, 10_000_000),
    "max_watchers": lambda name, raw: parse_int(name, raw, 1, 10_000_000),
    "max_watchers_per_token": lambda name, raw: parse_int(name, raw, 1, 10_000_000),
    "max_answer_bytes": _bytes(1024),
    "max_watch_timeout_ms": _ms(1000),
    "max_raft_handshakes": lambda name, raw: parse_int(name, raw, 1, 1_000_000),
}
REQUIRED = ("node_id", "data_dir", "listen_http", "listen_raft", "voters")

# Every METAKV_* environment variable anything in this repository reads. `serve` refuses any
# other METAKV_* name: a typo (METAKV_CLUSTER_SECRETS) would otherwise start a node on the
# default insecure secret without a word.
KNOWN_ENV_VARS: frozenset[str] = frozenset({
    *(ENV_PREFIX + setting.upper() for setting in SERVE_SETTINGS),
    "METAKV_CONFIG",  # serve: the TOML file
    "METAKV_TOKEN",  # status, cluster up: bearer token
    "METAKV_URL",  # status: the node to ask
    "METAKV_ENDPOINTS",  # the data commands (app/cli_data.py): the nodes to talk to
    "METAKV_LOCK_KEY",  # `metakv lock` exports them to its command (app/cli_coord.py)
    "METAKV_LOCK_VERSION",
    "METAKV_FAILPOINTS",  # storage/failpoints.py: fault injection in tests
    "METAKV_CRASH_ITERATIONS",  # tests/storage/test_crash.py
    "METAKV_BENCH_TRACE_OUT",  # loadtest/bench_write_path.py
    "METAKV_INPUT_ERROR",  # pipeline/errors.py marker, allowed should it ever reach the environment
})


def _non_empty(name: str, raw: Any) -> str:
    text = str(raw).strip()
    if not text:
        raise ConfigError(f"{name}: must not be empty")
    return text


def env_name(setting: str) -> str:
    return ENV_PREFIX + setting.upper()


def flag_name(setting: str) -> str:
    return "--" + setting.replace("_", "-")


def check_environment(environ: Mapping[str, str]) -> None:
    """Refuse a METAKV_* variable that nothing reads, naming the closest known one."""
    for name in sorted(environ):
        if name.startswith(ENV_PREFIX) and name not in KNOWN_ENV_VARS:
            # Compared without the shared prefix, which would make every name look close.
            suffixes = sorted(known.removeprefix(ENV_PREFIX) for known in KNOWN_ENV_VARS)
            close = difflib.get_close_matches(name.removeprefix(ENV_PREFIX), suffixes, n=1)
            hint = f" (did you mean {ENV_PREFIX}{close[0]}?)" if close else ""
            raise ConfigError(f"{name}: unknown environment variable{hint}; unset it or fix its name")


def load_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a TOML config file; settings sit either all at the top level or all under [serve].

    A file with a [serve] table and top-level keys besides it is refused: TOML puts every key
    written above the table at the top level, and reading only [serve] would silently drop
    them (a cluster_secret, or a typo nobody would ever be told about)."""
    try:
        data = read_toml(path, f"--config: file {str(path)!r}")
    except TomlFileError as exc:
        raise ConfigError(str(exc)) from None
    section = data
    if "serve" in data:
        section = data["serve"]
        if not isinstance(section, dict):
            raise ConfigError(f"--config: [serve] in {str(path)!r} must be a table")
        outside = sorted(key for key in data if key != "serve")
        if outside:
            raise ConfigError(f"--config: key {outside[0]!r} in {str(path)!r} is outside [serve]; "
                              "a file with a [serve] table must keep every setting in it")
    unknown = sorted(set(section) - set(SERVE_SETTINGS))
    if unknown:
        raise ConfigError(f"--config: unknown setting {unknown[0]!r} in {str(path)!r}")
    return dict(section)


def build_node_config(
    flags: Mapping[str, Any], environ: Mapping[str, str] | None = None, config_path: str | None = None
) -> NodeConfig:
    """Merge flags (None = not given) over METAKV_* env vars over the TOML file, then validate."""
    environ = os.environ if environ is None else environ
    check_environment(environ)
    config_path = config_path or environ.get(env_name("config")) or None
    from_file = load_toml(config_path) if config_path else {}
    values: dict[str, Any] = {}
    for setting, parse in SERVE_SETTINGS.items():
        raw: Any = flags.get(setting)
        source = flag_name(setting)
        if raw is None and env_name(setting) in environ:
            raw, source = environ[env_name(setting)], env_name(setting)
        if raw is None and setting in from_file:
            raw, source = from_file[setting], f"{setting} (in {config_path})"
        if raw is not None:
            values[setting] = parse(source, raw)
    _voters_elsewhere(values)
    for setting in REQUIRED:
        if setting not in values:
            raise ConfigError(f"{flag_name(setting)} (or {env_name(setting)}) is required")
    return _validate(values)


def _voters_elsewhere(values: dict[str, Any]) -> None:
    """--standalone (this node alone) and --bootstrap-servers (learned at start) stand in for
    --voters; given with it, they are refused."""
    chosen = [flag_name(name) for name in ("voters", "standalone", "bootstrap_servers") if values.get(name)]
    if len(chosen) > 1:
        raise ConfigError(f"{chosen[1]}: give one of --voters, --standalone and --bootstrap-servers, not {chosen[0]} too")
    if values.get("standalone"):
        if values.get("observer"):
            raise ConfigError("--standalone: the node is the only voter, so it cannot be an --observer")
        listen_raft = values.get("listen_raft")
        if listen_raft is not None and "node_id" in values:
            if listen_raft.port == 0:
                raise ConfigError("--standalone: --listen-raft needs a port (the voters record names it)")
            values["voters"] = {values["node_id"]: listen_raft}
    elif values.get("bootstrap_servers"):
        values["voters"] = {}  # app/cli_voters.py asks them before the node starts
        values["observer"] = True


def parse_url_list(name: str, raw: Any) -> tuple[str, ...]:
    """``http://h:1,http://h:2`` -> each checked by ``parse_url``; at least one."""
    urls = tuple(parse_url(name, item) for item in str(raw).split(",") if item.strip())
    if not urls:
        raise ConfigError(f"{name}: give at least one URL")
    return urls


def _validate(values: dict[str, Any]) -> NodeConfig:
    node_id: int = values["node_id"]
    voters: dict[int, HostPort] = values["voters"]
    observer = values.get("observer", False)
    if observer and node_id in voters:
        raise ConfigError(f"--observer: node {node_id} is listed in --voters; an observer must not be")
    if not observer and node_id not in voters and not values.get("bootstrap_servers"):
        raise ConfigError(f"--node-id: node {node_id} is not in --voters (pass --observer for a non-voter)")
    listen_http: HostPort = values["listen_http"]
    listen_raft: HostPort = values["listen_raft"]
    wildcards = {"0.0.0.0", "::", ""}
    if listen_http.port == listen_raft.port != 0 and (
            listen_http.host == listen_raft.host or listen_http.host in wildcards or listen_raft.host in wildcards):
        raise ConfigError(f"--listen-http: {listen_http} is also --listen-raft {listen_raft}; "
                          "HTTP and raft need different ports")
    if "advertise_http" not in values:
        host = listen_http.url_host if listen_http.host not in {"0.0.0.0", "::", ""} else "127.0.0.1"
        scheme = "https" if values.get("tls_cert_file") is not None else "http"
        values["advertise_http"] = f"{scheme}://{host}:{listen_http.port}"
    if values.get("listen_etcd_gateway") is not None and values.get("listen_etcd") is None:
        raise ConfigError("--listen-etcd-gateway: needs --listen-etcd (the gateway serves the same calls)")
    max_value_bytes = values.get("max_value_bytes", _NODE_DEFAULTS["max_value_bytes"])
    max_batch_bytes = values.get("max_batch_bytes", _NODE_DEFAULTS["max_batch_bytes"])
    if max_batch_bytes < max_value_bytes + RECORD_FRAMING_MAX_BYTES:
        raise ConfigError(f"--max-batch-bytes: {max_batch_bytes} cannot hold one write of --max-value-bytes "
                          f"{max_value_bytes}; it must be at least max_value_bytes + {RECORD_FRAMING_MAX_BYTES} "
                          f"= {max_value_bytes + RECORD_FRAMING_MAX_BYTES}")
    if values.get("fetch_timeout_ms", 2000) <= values.get("fetch_max_wait_ms", 500):
        raise ConfigError("--fetch-timeout-ms: must be greater than --fetch-max-wait-ms")
    if values.get("auth_file") is not None:
        try:
            values["auth_policy"] = load_auth_policy(values["auth_file"])
        except AuthFileError as exc:
            raise ConfigError(f"--auth-file: {exc}") from None
    _validate_security(values)
    return NodeConfig(**values)


# ---------------------------------------------------------------------------
# Security settings (docs/security.md)

# Below this a cluster secret on a network is refused: the handshake's MACs can be recorded
# by whoever a node dials, and a short secret is guessed offline from one of them.
MIN_NETWORK_SECRET_CHARS = 16


def parse_node_ids(name: str, raw: Any) -> frozenset[int]:
    """``4,5`` -> {4, 5}; empty -> none."""
    return frozenset(parse_int(f"{name} id", item, 0, 2**31 - 1) for item in str(raw).split(",") if item.strip())


def is_exposed_host(host: str) -> bool:
    """Whether a listener on ``host`` can be reached from other machines: a wildcard or any
    address that is not loopback. A name counts by what it resolves to; a name that does not
    resolve is not exposed (the node cannot listen there: its bind fails with its own line)."""
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return False
    return any(not ipaddress.ip_address(address.split("%", 1)[0]).is_loopback for address in addresses)


def _validate_security(values: dict[str, Any]) -> None:
    """TLS files in pairs and loadable (a bad file exits 2 now, not at the first connection),
    observers that are not voters, and no network listener on the built-in secret without TLS."""
    get = values.get
    if (get("tls_cert_file") is None) != (get("tls_key_file") is None):
        raise ConfigError("--tls-cert-file and --tls-key-file: give both or neither")
    if get("tls_client_ca_file") is not None and get("tls_cert_file") is None:
        raise ConfigError("--tls-client-ca-file: client certificates need HTTPS: give --tls-cert-file and --tls-key-file")
    peer_files = [get(name) for name in ("peer_tls_cert_file", "peer_tls_key_file", "peer_tls_ca_file")]
    if any(item is not None for item in peer_files) and not all(item is not None for item in peer_files):
        raise ConfigError("--peer-tls-cert-file, --peer-tls-key-file and --peer-tls-ca-file: give all three or none")
    try:
        if get("tls_cert_file") is not None:
            http_server_context(TlsFiles(get("tls_cert_file"), get("tls_key_file"), get("tls_client_ca_file")))
            if values["advertise_http"].startswith("http://"):
                raise ConfigError("--advertise-http: the node serves HTTPS (--tls-cert-file); advertise an https:// URL")
        if peer_files[0] is not None:
            peer_server_context(TlsFiles(peer_files[0], peer_files[1], peer_files[2]))
    except TlsFileError as exc:
        raise ConfigError(f"TLS: {exc}") from None
    voters_listed = sorted(get("allowed_observers", frozenset()) & set(values["voters"]))
    if voters_listed:
        raise ConfigError(f"--allowed-observers: node {voters_listed[0]} is a voter (voters may always connect)")
    listeners = (values["listen_http"], values["listen_raft"],
                 *(address for address in (get("listen_etcd"), get("listen_etcd_gateway")) if address is not None))
    exposed = [str(address) for address in listeners if is_exposed_host(address.host)]
    secret = get("cluster_secret", DEFAULT_CLUSTER_SECRET)
    if exposed and peer_files[0] is None and not get("insecure", False):
        if secret == DEFAULT_CLUSTER_SECRET:
            raise ConfigError(f"--cluster-secret: {exposed[0]} is not loopback and the cluster secret is the public "
                              "built-in one: set METAKV_CLUSTER_SECRET or peer TLS (--peer-tls-*), or pass --insecure")
        if len(secret) < MIN_NETWORK_SECRET_CHARS:
            raise ConfigError(f"--cluster-secret: {exposed[0]} is not loopback and the cluster secret has fewer than "
                              f"{MIN_NETWORK_SECRET_CHARS} characters: use a longer one or peer TLS, or pass --insecure")
