"""The ``metakv`` command: serve one node, run a local cluster, show a cluster's quorum;
the data commands are in app/cli_data.py.

    metakv serve --node-id 1 --data-dir ./data/1 --listen-http 127.0.0.1:8001 \\
        --listen-raft 127.0.0.1:9001 --voters 1@127.0.0.1:9001,2@127.0.0.1:9002,3@127.0.0.1:9003
    metakv cluster up [--voters 3] [--observers 1] [--base-http-port 8001] [--base-raft-port 9001]
    metakv status [--url http://127.0.0.1:8001]
    metakv voters list | add ID | remove ID                      (app/cli_voters.py)
    metakv repair --data-dir ./data/1 (--verify | --truncate-at OFFSET) [--dry-run]
    metakv get | put | del | list | watch | txn | snapshot ...   (app/cli_data.py)
    metakv lock | elect | lease ...                              (app/cli_coord.py)

Bad flags or configuration exit with code 2 and one line on stderr (argparse's multi-line
usage dump is replaced, so scripts and people see just what is wrong).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import resource
import shlex
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import uvicorn

from app.auth import AuthFileError, load_auth_policy
from app.cli_coord import COORDINATION_COMMANDS, add_coordination_commands, split_lock_command
from app.cli_data import DATA_COMMANDS, add_data_commands, run_data_command
from app.cli_voters import (
    BootstrapError,
    add_voters_commands,
    dynamic_voter_flags,
    grow_voters,
    run_voters_command,
    voters_from_bootstrap,
)
from app.config import (
    SERVE_SETTINGS,
    ConfigError,
    HostPort,
    NodeConfig,
    build_node_config,
    check_environment,
    env_name,
    flag_name,
    parse_int,
    parse_url,
)
from app.process_setup import prepare_serving_process

EXIT_USAGE = 2
EXIT_FAILURE = 1
CHILD_STOP_TIMEOUT_S = 15.0  # cluster up: how long children get to stop gracefully
CLUSTER_READY_TIMEOUT_S = 30.0
SWITCH_INTERVAL_S = 0.0005
HTTP_LISTEN_BACKLOG = 2048  # connections the kernel queues before uvicorn accepts (uvicorn's default)


class UsageError(Exception):
    """A command-line problem: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message}")


SERVE_HELP = {
    "max_header_bytes": "answer 431 and close a connection whose request line and headers pass this many bytes",
    "write_stall_timeout_ms": "disconnect a client whose send buffer stays full this long (one that stopped reading)",
    "max_connections": "answer 503 and close an HTTP connection past this many open on the node (kept below the descriptor limit)",
    "max_connections_per_client": "answer 503 and close an HTTP connection past this many open from one client address",
    "max_watchers": "answer 429 to a watch (long-poll or SSE) past this many open on the node",
    "max_watchers_per_token": "answer 429 to a watch past this many open for its token on the node (auth on)",
    "max_answer_bytes": "end a list page or a watch answer early (with where to continue) past this many bytes of values",
    "max_watch_timeout_ms": "longest watch: a long-poll's timeout_ms and an SSE stream's lifetime are clamped to it",
    "max_raft_handshakes": "close a raft connection at once past this many still in the handshake (TLS and secret)",
    "header_timeout_ms": "answer 408 and close a connection whose request headers are not complete this long after it opened",
    "max_lease_ttl_s": "the longest lease TTL a grant may ask for, in seconds (longer: 400 invalid-ttl; docs/leases.md)",
    "quota_bytes": "past this many bytes of state.db and log the leader answers writes 507; deletes still work (0 = no quota)",
    "cleaner_interval_ms": "how often the cleaner checks whether to compact the log (0 = never on its own)",
    "cleaner_min_dirty_ratio": "clean only when uncleaned bytes below the dirty offset are at least this fraction of the log (0..1)",
    "min_compaction_lag_ms": "leave records younger than this uncleaned, so at_version reads and watches reach back at least this far",
    "tombstone_retention_records": "keep tombstones this many offsets below the cleaned end (same on every node)",
    "snapshot_every_records": "take a snapshot after this many applied offsets (0 = only on demand)",
    "node_id": "this node's id (an integer)",
    "data_dir": "directory holding the log, quorum state, snapshots and state.db",
    "listen_http": "HOST:PORT for the HTTP API",
    "listen_raft": "HOST:PORT for raft traffic between nodes",
    "listen_etcd": "HOST:PORT for etcd's v3 API, gRPC and JSON gateway on one port (off unless given; docs/etcd.md)",
    "listen_etcd_gateway": "HOST:PORT: move etcd's JSON gateway to its own port; --listen-etcd then serves gRPC "
                           "alone (docs/etcd.md)",
    "voters": "the voters' raft addresses: ID@HOST:PORT,ID@HOST:PORT,...",
    "advertise_http": "this node's HTTP URL as clients reach it (default http://LISTEN-HTTP)",
    "observer": "run as a non-voting observer (its id must not be in --voters)",
    "standalone": "format an empty data directory with this node as the only voter (a cluster whose voters "
                  "`metakv voters add` / `remove` change; instead of --voters)",
    "bootstrap_servers": "join as an observer of the voters these nodes' /v1/status names: URL,URL,... "
                         "(instead of --voters; then `metakv voters add` it)",
    "cluster_id": "cluster id checked in the raft handshake",
    "cluster_secret": "shared secret proving raft peers belong to the cluster (use the env var)",
    "auth_file": "TOML token file: require Authorization: Bearer tokens on the HTTP API (docs/http.md, Auth)",
    "ui": "the web dashboard at /ui: on, off or read-only (docs/ui.md)",
    # security (docs/security.md)
    "tls_cert_file": "serve HTTPS with this certificate (PEM; SIGHUP reloads it)",
    "tls_key_file": "the private key of --tls-cert-file (PEM)",
    "tls_client_ca_file": "require HTTPS clients to present a certificate from this CA; its CN or SAN may name a token",
    "peer_tls_cert_file": "raft port mutual TLS: this node's certificate, naming node-<id> (metakv certs)",
    "peer_tls_key_file": "the private key of --peer-tls-cert-file",
    "peer_tls_ca_file": "raft port mutual TLS: the cluster's CA; peers without a certificate from it are refused",
    "allowed_observers": "observer ids that may connect to this node's raft port: ID,ID,... (voters always may)",
    "insecure": "start even though a listener is not on loopback with neither peer TLS nor a strong cluster secret",
}


def _build_parser() -> _Parser:
    parser = _Parser(prog="metakv", description="metakv: a replicated key-value metadata store")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    serve = commands.add_parser("serve", help="run one node in the foreground")
    serve.add_argument("--config", help="TOML file with settings (flags and METAKV_* env vars win)")
    for setting in SERVE_SETTINGS:
        help_text = SERVE_HELP.get(setting, setting.replace("_", " "))
        help_text += f" [env {env_name(setting)}]"
        if setting in ("observer", "insecure", "standalone"):
            serve.add_argument(flag_name(setting), dest=setting, action="store_const", const=True,
                               default=None, help=help_text)
        else:
            serve.add_argument(flag_name(setting), dest=setting, default=None, help=help_text)

    cluster = commands.add_parser("cluster", help="a local cluster of serve processes")
    cluster_commands = cluster.add_subparsers(dest="cluster_command", required=True, parser_class=_Parser)
    up = cluster_commands.add_parser("up", help="start voters and observers on loopback; Ctrl-C stops them")
    up.add_argument("--voters", default="3", help="number of voters (default 3)")
    up.add_argument("--observers", default="1", help="number of observers (default 1)")
    up.add_argument("--base-http-port", default="8001", help="HTTP port of node 1 (default 8001)")
    up.add_argument("--base-raft-port", default="9001", help="raft port of node 1 (default 9001)")
    up.add_argument("--base-etcd-port", default="2379",
                    help="etcd v3 gRPC port of node 1 (default 2379; 0 = no etcd API; docs/etcd.md)")
    up.add_argument("--base-etcd-gateway-port", default="0",
                    help="a separate etcd v3 JSON gateway port for node 1 (default 0: the gateway shares "
                         "the etcd port)")
    up.add_argument("--data-dir", default="./data", help="parent of the nodes' data dirs (default ./data)")
    up.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    up.add_argument("--auth-file", default=os.environ.get("METAKV_AUTH_FILE"),
                    help="token file every node enforces (docs/http.md, Auth; env METAKV_AUTH_FILE)")
    up.add_argument("--token", default=os.environ.get("METAKV_TOKEN"),
                    help="bearer token to find the leader with when auth is on (env METAKV_TOKEN)")
    up.add_argument("--dynamic", action="store_true",
                    help="node 1 starts --standalone, the others as its observers, then nodes 2..VOTERS are added "
                         "as voters one at a time (metakv voters add/remove change them later)")
    up.add_argument("--tls", action="store_true",
                    help="HTTPS and peer mutual TLS, with certificates made in DATA-DIR/certs (metakv certs)")
    certs = commands.add_parser("certs", help="make a CA and node/client certificates for TLS (docs/security.md)")
    certs.add_argument("--dir", default="./certs", help="where to write them (default ./certs; an existing CA is reused)")
    certs.add_argument("--nodes", default="1,2,3,4", help="node ids: ID,ID,... (default 1,2,3,4)")
    certs.add_argument("--clients", default="", help="client certificate names: NAME,... (a token of that name)")
    certs.add_argument("--hosts", default="127.0.0.1,localhost",
                       help="host names and addresses the node certificates are valid for")
    certs.add_argument("--days", default="365", help="validity in days (default 365)")

    status = commands.add_parser("status", help="print the quorum table of a running cluster")
    status.add_argument("--url", default=os.environ.get("METAKV_URL", "http://127.0.0.1:8001"),
                        help="node URLs, comma-separated: the only places the token is sent [env METAKV_URL] "
                             "(default http://127.0.0.1:8001)")
    status.add_argument("--timeout-ms", default="3000", help="per request (default 3000)")
    status.add_argument("--token", default=os.environ.get("METAKV_TOKEN"),
                        help="bearer token for a cluster with auth enabled [env METAKV_TOKEN]")
    status.add_argument("--cacert", help="CA file to verify https nodes with (metakv certs: ca.crt)")
    status.add_argument("--cert", help="client certificate, for nodes that require one")
    status.add_argument("--key", help="the client certificate's private key")
    repair = commands.add_parser("repair", help="verify a stopped node's log, or discard it from an offset on")
    repair.add_argument("--data-dir", default=os.environ.get("METAKV_DATA_DIR"),
                        help="the node's data directory [env METAKV_DATA_DIR]")
    action = repair.add_mutually_exclusive_group(required=True)
    action.add_argument("--verify", action="store_true", help="check every batch of every segment")
    action.add_argument("--truncate-at", metavar="OFFSET",
                        help="remove every record at OFFSET and above (the node re-fetches them)")
    repair.add_argument("--dry-run", action="store_true", help="say what --truncate-at would remove")
    add_data_commands(commands)
    add_coordination_commands(commands)
    add_voters_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        words, lock_command = split_lock_command(sys.argv[1:] if argv is None else argv)
        args = _build_parser().parse_args(words)
        if lock_command:
            args.cmd = lock_command
        if args.command == "serve":
            config = build_node_config(vars(args), config_path=args.config)
            if config.bootstrap_servers:
                try:
                    config = voters_from_bootstrap(config)
                except BootstrapError as exc:
                    print(f"metakv: cannot start node {config.node_id}: {exc}", file=sys.stderr)
                    return EXIT_FAILURE
            return serve(config)
        if args.command == "cluster":
            return cluster_up(args)
        if args.command == "repair":
            return repair(args)
        if args.command == "certs":
            return certs(args)
        if args.command in DATA_COMMANDS:
            return run_data_command(args)
        if args.command == "voters":
            return run_voters_command(args)
        if args.command in COORDINATION_COMMANDS:
            return run_data_command(args, COORDINATION_COMMANDS)
        return status(args)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    except ConfigError as exc:
        print(f"metakv: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


# --------------------------------------------------------------------------- serve


def serve(config: NodeConfig) -> int:
    """Run one node until SIGTERM/SIGINT: a leader resigns first, then HTTP and raft stop."""
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s node{config.node_id} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Two threads share the GIL: the event loop and the log-flush thread. A finished fsync
    # should not wait the default 5 ms for the busy loop thread to let go of the GIL before it
    # can report the flush (every commit waits on that report); 0.5 ms measured ~10 % more
    # in-process group-commit throughput at 64 concurrent writers.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    prepare_serving_process()  # descriptor limit, umask 0o077 (app/process_setup.py)
    from app.http.tls_handshake import bounded_tls_handshake_loop

    tls_handshake_s = config.header_timeout_ms / 1000  # an HTTPS handshake is bounded like the headers
    try:
        import uvloop
    except ImportError:  # uvicorn[standard] brings uvloop; fall back rather than fail
        with asyncio.Runner(loop_factory=bounded_tls_handshake_loop(asyncio.SelectorEventLoop, tls_handshake_s)) as runner:
            return runner.run(_serve(config))
    return uvloop.run(_serve(config), loop_factory=bounded_tls_handshake_loop(uvloop.Loop, tls_handshake_s))


async def _serve(config: NodeConfig) -> int:
    try:
        http_socket = _bind_http(config.listen_http)
    except _StartupError as exc:
        print(f"metakv: cannot start node {config.node_id}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    try:
        return await _serve_on(config, http_socket)
    finally:
        http_socket.close()


async def _serve_on(config: NodeConfig, http_socket: socket.socket) -> int:
    from app.http import create_app
    from app.http.client_certs import ClientCertHttpToolsProtocol
    from app.http.settings import HttpSettings
    from app.http.uvicorn_protocol import (
        CoalescingHttpToolsProtocol,
        ConnectionLimits,
        connections_closed_counter,
    )
    from app.runtime import NodeRuntime
    from app.sighup import reload_on_sighup
    from app.tls import http_server_context

    runtime = NodeRuntime(config)
    loop = asyncio.get_running_loop()
    # SIGHUP reloads the token file and the certificates (app/sighup.py, docs/security.md).
    http_tls = config.http_tls
    http_context = http_server_context(http_tls) if http_tls is not None else None
    loop.add_signal_handler(signal.SIGHUP, reload_on_sighup, config, runtime, http_context)
    try:
        await runtime.start()
    except Exception as exc:  # corrupt files name file and byte offset; a taken port its address
        logging.getLogger("metakv").debug("startup failed", exc_info=exc)
        print(f"metakv: cannot start node {config.node_id}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    app = create_app(runtime, HttpSettings(
        max_value_bytes=runtime.max_value_bytes, max_watchers=config.max_watchers,
        max_watchers_per_token=config.max_watchers_per_token, max_answer_bytes=config.max_answer_bytes,
        max_watch_timeout_ms=config.max_watch_timeout_ms), ui=config.ui)
    # Everything built so far (modules, FastAPI app, pydantic schemas, SQLAlchemy metadata)
    # lives as long as the process: move it out of the collector's reach, so a full
    # collection no longer scans ~85,000 startup objects on the event loop (a 10-250 ms
    # stall, measured; one shows up in every p99).
    gc.collect()
    gc.freeze()
    limits = ConnectionLimits(config.max_header_bytes, config.header_timeout_ms / 1000,
                              config.write_stall_timeout_ms / 1000, _connection_cap(config.max_connections),
                              config.max_connections_per_client, closed=connections_closed_counter(runtime.metrics))
    protocol = CoalescingHttpToolsProtocol if http_context is None else ClientCertHttpToolsProtocol
    server = _Server(uvicorn.Config(
        app, host=config.listen_http.host, port=config.listen_http.port, loop="none",
        http=protocol.with_limits(limits),
        lifespan="off", access_log=False, log_level="warning",
        timeout_graceful_shutdown=2, server_header=False, proxy_headers=False,
        ssl_context_factory=None if http_context is None else lambda _config, _default: http_context,
    ))
    stopping: list[asyncio.Task[None]] = []

    async def graceful() -> None:
        await runtime.begin_shutdown()  # resign and wait for a successor while still serving
        server.should_exit = True

    def on_signal(signum: int) -> None:
        if stopping:  # a second signal: stop now
            server.force_exit = True
            server.should_exit = True
            return
        logging.getLogger("metakv").info("signal %s: shutting down", signal.Signals(signum).name)
        stopping.append(asyncio.ensure_future(graceful()))

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    etcd = None
    try:
        if config.listen_etcd is not None:
            from app.etcd.serve import EtcdApi
            etcd = EtcdApi.of_node(runtime, config, runtime.auth_tokens)
            loop.add_signal_handler(signal.SIGHUP, _reload_with_etcd, config, runtime, http_context, etcd)
            try:
                await etcd.start()
            except (OSError, RuntimeError) as exc:  # a taken port: grpc raises RuntimeError
                print(f"metakv: cannot start node {config.node_id}: {exc}", file=sys.stderr)
                return EXIT_FAILURE
        await server.serve(sockets=[http_socket])
    finally:
        if etcd is not None:
            await etcd.stop()
        await runtime.stop()
    return 0 if server.started else EXIT_FAILURE


def _reload_with_etcd(config: NodeConfig, runtime: Any, http_context: ssl.SSLContext | None, etcd: Any) -> None:
    """SIGHUP with the etcd port on: what app/sighup.py reloads, and the etcd port's certificate."""
    from app.sighup import reload_on_sighup

    reload_on_sighup(config, runtime, http_context)
    etcd.reload_tls()


def _connection_cap(configured: int) -> int:
    """``--max-connections``, lowered to leave descriptors for the log, raft and SQLite
    (a quarter of the limit, at most 256): HTTP clients alone cannot exhaust them."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    cap = max(1, min(configured, soft - min(256, soft // 4)))
    if cap < configured:
        logging.getLogger("metakv").info("HTTP connections capped at %d (file descriptor limit %d)", cap, soft)
    return cap


class _StartupError(Exception):
    """The node cannot start; the message is one line naming the setting."""


def _bind_http(address: HostPort) -> socket.socket:
    """Listen on the HTTP address before the raft side starts (uvicorn then serves on this
    socket). Left to uvicorn, a taken or unresolvable address surfaced only after the node had
    joined the cluster, as several lines and exit code 3; here it is one line and exit 1,
    like a taken raft port."""
    where = f"--listen-http {address}"
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            address.host, address.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise _StartupError(f"{where}: cannot resolve {address.host!r} ({exc})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: rebind over TIME_WAIT
        sock.bind(sockaddr)
        sock.listen(HTTP_LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise _StartupError(f"{where}: {exc.strerror or exc}") from None
    return sock


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: _serve installs handlers that resign
    leadership before HTTP stops, and nothing re-raises the signal afterwards."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


# --------------------------------------------------------------------------- cluster up


def cluster_up(args: argparse.Namespace) -> int:
    check_environment(os.environ)  # every child would refuse it; say so once, before starting any
    voters = parse_int("--voters", args.voters, 1, 9)
    observers = parse_int("--observers", args.observers, 0, 9)
    base_http = parse_int("--base-http-port", args.base_http_port, 1, 65535 - voters - observers)
    base_raft = parse_int("--base-raft-port", args.base_raft_port, 1, 65535 - voters - observers)
    base_etcd = parse_int("--base-etcd-port", args.base_etcd_port, 0, 65535 - voters - observers)
    base_gateway = parse_int("--base-etcd-gateway-port", args.base_etcd_gateway_port, 0,
                             65535 - voters - observers)
    if base_gateway and not base_etcd:
        raise ConfigError("--base-etcd-gateway-port: needs --base-etcd-port (the gateway serves the same calls)")
    bases = {"--base-http-port": base_http, "--base-raft-port": base_raft, "--base-etcd-port": base_etcd,
             "--base-etcd-gateway-port": base_gateway}
    started = [(flag, base) for flag, base in bases.items() if base]
    for index, (flag, base) in enumerate(started):
        for other_flag, other in started[index + 1:]:
            if abs(base - other) < voters + observers:
                raise ConfigError(f"{flag} and {other_flag} ranges overlap")
    data_dir = Path(args.data_dir)
    host = args.host.strip().removeprefix("[").removesuffix("]")  # HostPort adds IPv6 brackets back
    if args.auth_file:
        try:
            load_auth_policy(args.auth_file)  # a bad file is one line and exit 2 here, not 4 times
        except AuthFileError as exc:
            raise ConfigError(f"--auth-file: {exc}") from None
    count = voters + observers
    voter_spec = ",".join(f"{i}@{HostPort(host, base_raft + i - 1)}" for i in range(1, voters + 1))
    certs_dir = (data_dir / "certs").resolve()
    if args.tls:
        _cluster_certs(certs_dir, count, host)
    children: list[tuple[int, str, subprocess.Popen[bytes]]] = []
    stop_requested = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stop_requested
        stop_requested = True

    # SIGHUP too: a closed terminal must not leave the children (each in its own session, so
    # the terminal's hangup does not reach them) running with nobody to stop them.
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    try:
        for node_id in range(1, count + 1):
            http_address = HostPort(host, base_http + node_id - 1)
            url = f"{'https' if args.tls else 'http'}://{http_address}"
            command = [
                sys.executable, "-m", "app.cli", "serve", "--node-id", str(node_id),
                "--data-dir", str(data_dir / str(node_id)),
                "--listen-http", str(http_address),
                "--listen-raft", str(HostPort(host, base_raft + node_id - 1)),
                *(dynamic_voter_flags(node_id, count, HostPort(host, base_raft)) if args.dynamic
                  else ["--voters", voter_spec]),
            ]
            if base_etcd:
                command += ["--listen-etcd", str(HostPort(host, base_etcd + node_id - 1))]
            if base_gateway:
                command += ["--listen-etcd-gateway", str(HostPort(host, base_gateway + node_id - 1))]
            if node_id > voters and not args.dynamic:
                command.append("--observer")
            if observers and not args.dynamic:  # voters let only these observers connect
                command += ["--allowed-observers", ",".join(str(i) for i in range(voters + 1, count + 1))]
            if args.auth_file:
                command += ["--auth-file", str(Path(args.auth_file).resolve())]
            if args.tls:
                command += _tls_flags(certs_dir, node_id)
            # Children ignore the terminal's Ctrl-C (own process group): this process stops
            # them in order with SIGTERM so each shuts down gracefully exactly once.
            children.append((node_id, url, subprocess.Popen(command, start_new_session=True)))
        _print_banner(children, voters, auth=bool(args.auth_file),
                      etcd_endpoints=[str(HostPort(host, base_etcd + index)) for index in range(count)]
                      if base_etcd else [])
        if args.tls:
            print(f"TLS is on: add --cacert {certs_dir / 'ca.crt'} to each curl"
                  + (" and etcdctl (https:// endpoints)" if base_etcd else "") + "\n", flush=True)
        # A node that exits while starting (a taken port, a bad data dir) ends the wait at
        # once: the cluster the banner promised is not there, so everything stops, exit 1.
        leader = _wait_for_leader([url for _, url, _ in children],
                                  lambda: stop_requested or any(p.poll() is not None for _, _, p in children),
                                  args.token, verify=_trusting(certs_dir / "ca.crt") if args.tls else True)
        failed = [(node_id, p.returncode) for node_id, _, p in children if p.poll() is not None]
        if failed and not stop_requested:
            for node_id, code in failed:
                print(f"node {node_id} exited with code {code} while the cluster was starting; "
                      "stopping the cluster", file=sys.stderr, flush=True)
            return EXIT_FAILURE
        if stop_requested:
            return 0
        if leader and args.dynamic:
            grown = grow_voters(leader, [(node_id, str(HostPort(host, base_raft + node_id - 1)))
                                         for node_id in range(2, voters + 1)],
                                args.token, _trusting(certs_dir / "ca.crt") if args.tls else True,
                                lambda: stop_requested or any(p.poll() is not None for _, _, p in children))
            if not grown:
                return EXIT_FAILURE
        if leader:
            print(f"leader: {leader}   (Ctrl-C stops the cluster)", flush=True)
        return _supervise(children, lambda: stop_requested)
    finally:
        _stop_children([process for _, _, process in children])


SUPERVISE_POLL_INTERVAL_S = 0.2


def _supervise(children: Sequence[tuple[int, str, Any]], stop_requested: Any,
               poll_interval_s: float = SUPERVISE_POLL_INTERVAL_S) -> int:
    """Watch a cluster that is up until the user stops it (0) or every node has exited (1).

    A node that exits is reported once and the others keep running: stopping a node by its pid
    (the banner prints them) is how a user tries a failover, and that must not take the rest of
    the cluster down with it."""
    reported: set[int] = set()
    while not stop_requested():
        for node_id, _url, process in children:
            if node_id not in reported and process.poll() is not None:
                reported.add(node_id)
                running = sum(p.poll() is None for _, _, p in children)
                print(f"node {node_id} exited with code {process.returncode}; {running} of {len(children)} "
                      "nodes still running (Ctrl-C stops the cluster)", file=sys.stderr, flush=True)
        if len(reported) == len(children):
            print("every node has exited; cluster up stops", file=sys.stderr, flush=True)
            return EXIT_FAILURE
        time.sleep(poll_interval_s)
    return 0


def _print_banner(children: list[tuple[int, str, subprocess.Popen[bytes]]], voters: int, auth: bool,
                  etcd_endpoints: tuple[str, ...] | list[str] = ()) -> None:
    print("metakv local cluster:", flush=True)
    for node_id, url, process in children:
        kind = "voter" if node_id <= voters else "observer"
        print(f"  node {node_id} ({kind:8s}) {url}   pid {process.pid}", flush=True)
    first = children[0][1]
    print(f"""
try:
  curl -L -X PUT --data-binary 'hello' {first}/v1/kv/greeting
  curl {first}/v1/kv/greeting
  curl '{first}/v1/kv?prefix=gr'
  V=$(curl -s '{first}/v1/kv?prefix=gr' | python3 -c 'import json,sys; print(json.load(sys.stdin)["version"])')
  curl "{first}/v1/watch?prefix=gr&since=$V&timeout_ms=10000"   # waits for the next change under gr
  curl {first}/v1/status
  {_metakv_command()} status --url {first}
""", flush=True)
    if etcd_endpoints:
        user = " --user TOKEN_NAME:TOKEN" if auth else ""
        print(f"etcd's v3 API (docs/etcd.md): etcdctl --endpoints {','.join(etcd_endpoints)}{user} put greeting hi\n",
              flush=True)
    if auth:
        print('auth is on: add -H "Authorization: Bearer $TOKEN" to each curl (with -L also '
              '--location-trusted), and set METAKV_TOKEN for metakv status\n', flush=True)


def _metakv_command() -> str:
    """This very metakv, as a command that works pasted from any directory.

    `make run` starts .venv/bin/metakv without activating the venv, so a bare `metakv` is not
    on the user's PATH: name the script by its absolute path, or, when run as
    `python -m app.cli`, this interpreter with the directory app/ is imported from."""
    script = sys.argv[0] if sys.argv else ""
    if Path(script).name.removesuffix(".exe") == "metakv" and os.path.isfile(script):
        return shlex.quote(os.path.abspath(script))
    package_root = Path(__file__).resolve().parent.parent
    return f"PYTHONPATH={shlex.quote(str(package_root))} {shlex.quote(sys.executable)} -m app.cli"


def _wait_for_leader(urls: list[str], stop: Any, token: str | None = None, verify: Any = True) -> str | None:
    """Wait until every node answers /healthz and one of them says it leads; return its URL.

    A quorum elects a leader while a slower node may still be importing, so the leader alone
    does not mean every URL in the banner works; the leader line waits for all of them."""
    import httpx

    deadline = time.monotonic() + CLUSTER_READY_TIMEOUT_S
    headers = {"Authorization": f"Bearer {token}"} if token else None
    serving: set[str] = set()
    leader: str | None = None
    unauthorized = False
    with httpx.Client(timeout=1.0, headers=headers, verify=verify) as client:
        while time.monotonic() < deadline and not stop():
            for url in urls:
                if url not in serving:
                    try:
                        if client.get(f"{url}/healthz").status_code == 200:
                            serving.add(url)
                    except httpx.HTTPError:
                        continue
                if leader is not None or unauthorized:
                    continue
                try:
                    response = client.get(f"{url}/v1/status")
                    if response.status_code == 401:
                        unauthorized = True
                        continue
                    body = response.json()
                except (httpx.HTTPError, ValueError):
                    continue
                if body.get("role") == "leader":
                    leader = str(url)
            if len(serving) == len(urls):
                if unauthorized:
                    print("leader: not shown (auth is on: pass --token or set METAKV_TOKEN)",
                          file=sys.stderr, flush=True)
                    return None
                if leader is not None:
                    return leader
            time.sleep(0.2)
    if not stop():
        print(f"leader: none within {CLUSTER_READY_TIMEOUT_S:.0f} s (the nodes keep running; `metakv status` "
              "shows the quorum; Ctrl-C stops the cluster)", file=sys.stderr, flush=True)
    return None


def _stop_children(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + CHILD_STOP_TIMEOUT_S
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _cluster_certs(certs_dir: Path, count: int, host: str) -> None:
    """cluster up --tls: a CA and one certificate per node, made once and reused."""
    from app.certs import CertsError, make_certs
    from app.tls import node_name

    missing = [node_id for node_id in range(1, count + 1) if not (certs_dir / f"{node_name(node_id)}.crt").exists()]
    try:
        make_certs(certs_dir, missing, hosts=sorted({host, "127.0.0.1", "localhost"}))
    except CertsError as exc:
        raise ConfigError(f"--tls: {exc}") from None


def _trusting(ca_file: Path) -> Any:
    import ssl

    return ssl.create_default_context(cafile=str(ca_file))


def _tls_flags(certs_dir: Path, node_id: int) -> list[str]:
    from app.tls import node_name

    cert, key = str(certs_dir / f"{node_name(node_id)}.crt"), str(certs_dir / f"{node_name(node_id)}.key")
    return ["--tls-cert-file", cert, "--tls-key-file", key, "--peer-tls-cert-file", cert,
            "--peer-tls-key-file", key, "--peer-tls-ca-file", str(certs_dir / "ca.crt")]


# --------------------------------------------------------------------------- certs


def certs(args: argparse.Namespace) -> int:
    from app.certs import CertsError, make_certs

    node_ids = sorted({parse_int("--nodes", item, 0, 2**31 - 1) for item in args.nodes.split(",") if item.strip()})
    clients = [item.strip() for item in args.clients.split(",") if item.strip()]
    hosts = [item.strip() for item in args.hosts.split(",") if item.strip()]
    days = parse_int("--days", args.days, 1, 36500)
    try:
        written = make_certs(Path(args.dir), node_ids, clients, hosts, days)
    except CertsError as exc:
        raise ConfigError(str(exc)) from None
    for path in written:
        print(path)
    return 0


# --------------------------------------------------------------------------- repair


def repair(args: argparse.Namespace) -> int:
    """``storage.repair`` behind the metakv command: run it with the node stopped, after a
    startup error named the corrupt file and the offset to truncate at."""
    from storage import repair as storage_repair

    if not args.data_dir:
        raise ConfigError("--data-dir (or METAKV_DATA_DIR) is required")
    if not (Path(args.data_dir) / "log").is_dir():
        raise ConfigError(f"--data-dir: {args.data_dir!r} holds no log/ directory")
    argv = ["--data-dir", str(args.data_dir)]
    if args.verify:
        argv.append("--verify")
    else:
        argv += ["--truncate-at", str(parse_int("--truncate-at", args.truncate_at, 0, 2**62))]
    if args.dry_run:
        argv.append("--dry-run")
    return storage_repair.main(argv)


# --------------------------------------------------------------------------- status


def status(args: argparse.Namespace) -> int:
    from app.status_client import httpx_verify, print_status

    timeout_s = parse_int("--timeout-ms", args.timeout_ms, 1, 600_000) / 1000
    # --url lists the cluster members: the only origins the token is sent to.
    members = [parse_url("--url", item) for item in str(args.url).split(",") if item.strip()]
    if not members:
        raise ConfigError("--url: give at least one node URL")
    if (args.cert is None) != (args.key is None):
        raise ConfigError("--cert and --key: give both or neither")
    verify = httpx_verify(args.cacert, args.cert, args.key)
    return print_status(members, args.token, timeout_s, verify)


if __name__ == "__main__":
    sys.exit(main())
