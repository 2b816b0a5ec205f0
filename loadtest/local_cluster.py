"""A local metakv cluster of real ``metakv serve`` processes on loopback.

Used by the load benchmarks (``bench_http``, ``bench_write_path``), by the load-test runs'
clusters (``loadtest/clusters.py``, which runs etcd members as ``Node``s too) and, through
``tests/cluster.py``, by the integration, chaos and compaction tests. Every node is a
separate process started with ``python -m app.cli serve`` on free ports picked at run time;
its stdout/stderr go to ``<root>/node<id>.log``. A ``Cluster`` always kills what it started
(``close()`` and the context manager do), even when its caller fails, and only by pid.

    from loadtest.local_cluster import Cluster

    with Cluster(root, voters=3, observers=1) as cluster:
        leader = cluster.wait_for_leader()
        response = cluster.client().put(f"{leader.url}/v1/kv/a", content=b"1")
        cluster.kill(leader)                      # SIGKILL
        new_leader = cluster.wait_for_leader(exclude={leader.node_id})
        cluster.restart(leader)

Waits are bounded and generous (the machine may be shared); nothing here asserts on timing.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

# The directory holding the loadtest, app, raft and storage packages (the repository, or
# site-packages): nodes run `python -m app.cli` from it, so they import this same code.
SOURCE_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_WAIT_S = 30.0  # generous: the machine may be shared
POLL_INTERVAL_S = 0.05
STOP_TIMEOUT_S = 15.0
LOG_TAIL_BYTES = 4000


LISTEN_PORTS_LOW = 15_000  # free_ports draws from here to below the ephemeral range


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


# The ports free_ports returned in this process lately (port -> monotonic time): a node still
# importing Python has not bound its ports yet, and an etcd started meanwhile must not be
# handed the same ones.
_HANDED_OUT: dict[int, float] = {}
HANDED_OUT_HOLD_S = 120.0


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct free ports (held open together so they differ), drawn below the
    kernel's ephemeral range: a port bound to 0 is ephemeral, and the outgoing connections
    of servers started meanwhile (etcd's peers) may take it before our server binds it."""
    sockets: list[socket.socket] = []
    now = time.monotonic()
    candidates = list(range(LISTEN_PORTS_LOW, max(LISTEN_PORTS_LOW + count, _ephemeral_low())))
    random.SystemRandom().shuffle(candidates)
    try:
        for port in candidates:
            if len(sockets) == count:
                break
            if now - _HANDED_OUT.get(port, -HANDED_OUT_HOLD_S) < HANDED_OUT_HOLD_S:
                continue  # free now, but a server this process started may not have bound it yet
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind((host, port))
            except OSError:
                sock.close()
                continue
            sockets.append(sock)
        while len(sockets) < count:  # that range is taken: fall back to the kernel's choice
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        ports = [int(sock.getsockname()[1]) for sock in sockets]
        _HANDED_OUT.update(dict.fromkeys(ports, now))
        return ports
    finally:
        for sock in sockets:
            sock.close()


@dataclass
class Node:
    """One server process (or its slot, while it is stopped): a ``metakv serve``, or an etcd
    member for the load tests (``loadtest/clusters.py``; its peer port is ``raft_port``)."""

    node_id: int
    http_port: int
    raft_port: int
    data_dir: Path
    log_path: Path
    observer: bool = False
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    etcd_port: int = 0  # a metakv node's etcd v3 API (Cluster(etcd=True)); 0: none
    etcd_gateway_port: int = 0  # and its JSON gateway
    process: subprocess.Popen[bytes] | None = None
    paused: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def raft_address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.raft_port)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        if self.running():
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"---- start {time.strftime('%H:%M:%S')} ----\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, cwd=SOURCE_ROOT,
                env=self.env, start_new_session=True,
            )
        self.paused = False

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=STOP_TIMEOUT_S)
        self.paused = False

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM (graceful: a leader resigns first); SIGKILL if it does not exit in time.
        Returns the exit code."""
        if self.process is None:
            return None
        if self.paused:
            self.resume()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=STOP_TIMEOUT_S)
        return self.process.returncode

    def pause(self) -> None:
        """SIGSTOP: the process freezes with its sockets open."""
        self.signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        self.signal(signal.SIGCONT)
        self.paused = False

    def log_tail(self, max_bytes: int = LOG_TAIL_BYTES) -> str:
        try:
            data = self.log_path.read_bytes()
        except FileNotFoundError:
            return ""
        return data[-max_bytes:].decode(errors="replace")


class Cluster:
    """N voters and M observers as local processes; see the module docstring."""

    def __init__(
        self,
        root: Path,
        voters: int = 3,
        observers: int = 0,
        *,
        settings: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        cluster_secret: str = "test-cluster-secret",
        cluster_id: str | None = None,
        token: str | None = None,
        etcd: bool = False,
    ) -> None:
        """``settings``: extra serve settings for every node, by name (``election_timeout_ms=500``),
        passed as flags. ``env``: extra environment variables for every node.

        Every cluster gets its own random ``cluster_id`` unless one is given: many clusters run
        on this machine at once, and a port freed by one can be reused by another; the raft
        handshake refuses peers of another cluster id, so nodes never join a foreign cluster.

        ``token``: a bearer token the shared client sends (nodes started with an auth file).
        ``etcd``: every node also serves etcd's v3 API (--listen-etcd) on ``Node.etcd_port`` and
        its JSON gateway on ``Node.etcd_gateway_port``."""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        count = voters + observers
        ports = free_ports((4 if etcd else 2) * count)
        voter_spec = ",".join(f"{i}@127.0.0.1:{ports[2 * (i - 1) + 1]}" for i in range(1, voters + 1))
        self.cluster_id = cluster_id or f"test-{uuid.uuid4().hex[:12]}"
        base_env = {**os.environ, "PYTHONUNBUFFERED": "1", "METAKV_CLUSTER_SECRET": cluster_secret,
                    "METAKV_CLUSTER_ID": self.cluster_id, **(env or {})}
        base_env.pop("METAKV_CONFIG", None)
        self.nodes: dict[int, Node] = {}
        for index in range(count):
            node_id = index + 1
            http_port, raft_port = ports[2 * index], ports[2 * index + 1]
            data_dir = self.root / f"node{node_id}"
            command = [
                sys.executable, "-m", "app.cli", "serve",
                "--node-id", str(node_id), "--data-dir", str(data_dir),
                "--listen-http", f"127.0.0.1:{http_port}", "--listen-raft", f"127.0.0.1:{raft_port}",
                "--voters", voter_spec,
            ]
            etcd_port, gateway_port = (ports[2 * count + 2 * index], ports[2 * count + 2 * index + 1]) if etcd else (0, 0)
            if etcd:
                command += ["--listen-etcd", f"127.0.0.1:{etcd_port}", "--listen-etcd-gateway", f"127.0.0.1:{gateway_port}"]
            if node_id > voters:
                command.append("--observer")
            if observers:  # voters let only listed observers connect
                command += ["--allowed-observers", ",".join(str(i) for i in range(voters + 1, count + 1))]
            for name, value in (settings or {}).items():
                command += ["--" + name.replace("_", "-"), str(value)]
            self.nodes[node_id] = Node(node_id, http_port, raft_port, data_dir, self.root / f"node{node_id}.log",
                                       observer=node_id > voters, command=command, env=dict(base_env),
                                       etcd_port=etcd_port, etcd_gateway_port=gateway_port)
        self.token = token
        self._client: httpx.Client | None = None

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> Cluster:
        for node in self.nodes.values():
            node.start()
        return self

    def close(self) -> None:
        """Kill every process this cluster started (SIGCONT first for paused ones)."""
        for node in self.nodes.values():
            if node.paused:
                node.resume()
            with contextlib.suppress(Exception):
                node.kill()
        if self._client is not None:
            self._client.close()
            self._client = None

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def voters(self) -> list[Node]:
        return [node for node in self.nodes.values() if not node.observer]

    @property
    def observers(self) -> list[Node]:
        return [node for node in self.nodes.values() if node.observer]

    def kill(self, node: Node) -> None:
        node.kill()

    def restart(self, node: Node) -> None:
        node.kill()
        node.start()

    # ---------------------------------------------------------------- HTTP

    def client(self) -> httpx.Client:
        """A shared keep-alive client that does not follow redirects (tests look at 307s)."""
        if self._client is None:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
            self._client = httpx.Client(timeout=10.0, headers=headers)
        return self._client

    def status(self, node: Node, timeout_s: float = 2.0) -> dict[str, Any] | None:
        """GET /v1/status, or None when the node does not answer."""
        if not node.running() or node.paused:
            return None
        try:
            response = self.client().get(f"{node.url}/v1/status", timeout=timeout_s)
        except httpx.HTTPError:
            return None
        return response.json() if response.status_code == 200 else None

    def wait_for_leader(self, timeout_s: float = DEFAULT_WAIT_S, exclude: Sequence[int] = ()) -> Node:
        """The node that reports itself leader, with a majority of the answering voters
        agreeing on it (so a write sent to it is not redirected elsewhere), once every running,
        unpaused node answers HTTP (a node still starting on a loaded machine would refuse the
        test's next request)."""
        deadline = time.monotonic() + timeout_s
        while True:
            statuses = {node.node_id: self.status(node) for node in self.nodes.values()
                        if node.node_id not in exclude}
            starting = [node_id for node_id, s in statuses.items()
                        if s is None and self.nodes[node_id].running() and not self.nodes[node_id].paused]
            leaders = [s for s in statuses.values() if s is not None and s.get("role") == "leader"]
            if leaders and not starting:
                leader = max(leaders, key=lambda s: s["epoch"])
                agreeing = [s for s in statuses.values() if s is not None and s.get("leader_id") == leader["node_id"]]
                if len(agreeing) >= len(self.voters) // 2 + 1 or len(agreeing) == len(
                        [s for s in statuses.values() if s is not None]):
                    return self.nodes[int(leader["node_id"])]
            if time.monotonic() > deadline:
                raise AssertionError(f"no leader within {timeout_s}s; statuses: {statuses}\n{self.logs()}")
            time.sleep(POLL_INTERVAL_S * 4)

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float = DEFAULT_WAIT_S,
                   what: str = "condition") -> None:
        """Poll ``predicate`` until true; fail with the nodes' logs after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not reached within {timeout_s}s\n{self.logs()}")
            time.sleep(POLL_INTERVAL_S)

    def wait_ready(self, node: Node, timeout_s: float = DEFAULT_WAIT_S) -> None:
        def ready() -> bool:
            if not node.running() or node.paused:
                return False
            try:
                return self.client().get(f"{node.url}/readyz", timeout=2.0).status_code == 200
            except httpx.HTTPError:
                return False
        self.wait_until(ready, timeout_s, f"node {node.node_id} ready")

    def put(self, key: str, value: bytes, *, node: Node | None = None, headers: Mapping[str, str] | None = None,
            timeout_s: float = 10.0) -> httpx.Response:
        """PUT through ``node`` (default: the current leader), following redirects."""
        target = node or self.wait_for_leader()
        return self.client().put(f"{target.url}/v1/kv/{key}", content=value, headers=headers,
                                 follow_redirects=True, timeout=timeout_s)

    def logs(self) -> str:
        """The tail of every node's log, for failure messages."""
        parts = []
        for node in self.nodes.values():
            parts.append(f"==== node {node.node_id} (pid {node.pid}, running={node.running()}) ====\n"
                         f"{node.log_tail()}")
        return "\n".join(parts)
