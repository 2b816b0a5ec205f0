"""A local metakv cluster of real ``metakv serve`` processes on loopback, for tests.

Shared by the integration, chaos and load tests. Every node is a separate process started
with ``python -m app.cli serve`` on free ports picked at run time; its stdout/stderr go to
``<root>/<id>.log``. A ``Cluster`` always kills what it started (``close()``, the context
manager and the ``cluster_factory`` fixture all do), even when a test fails, and only by pid.

    from tests.cluster import Cluster

    with Cluster(tmp_path, voters=3, observers=1) as cluster:
        leader = cluster.wait_for_leader()
        response = cluster.client().put(f"{leader.url}/v1/kv/a", content=b"1")
        cluster.kill(leader)                      # SIGKILL
        new_leader = cluster.wait_for_leader(exclude={leader.node_id})
        cluster.restart(leader)

Or as a pytest fixture (import it into your conftest.py):

    from tests.cluster import cluster_factory  # noqa: F401

    def test_x(cluster_factory):
        cluster = cluster_factory(voters=3)

Waits are bounded and generous (this machine is shared); nothing here asserts on timing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_WAIT_S = 30.0  # generous: 8 engineers share 2 cores
POLL_INTERVAL_S = 0.05
STOP_TIMEOUT_S = 15.0
LOG_TAIL_BYTES = 4000


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind to 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct free ports (held open together so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass
class Node:
    """One ``metakv serve`` process (or its slot, while it is stopped)."""

    node_id: int
    http_port: int
    raft_port: int
    data_dir: Path
    log_path: Path
    observer: bool = False
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
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
                self.command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
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
    ) -> None:
        """``settings``: extra serve settings for every node, by name (``election_timeout_ms=500``),
        passed as flags. ``env``: extra environment variables for every node.

        Every cluster gets its own random ``cluster_id`` unless one is given: many clusters run
        on this machine at once, and a port freed by one can be reused by another; the raft
        handshake refuses peers of another cluster id, so nodes never join a foreign cluster.

        ``token``: a bearer token the shared client sends (nodes started with an auth file)."""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        count = voters + observers
        ports = free_ports(2 * count)
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
            if node_id > voters:
                command.append("--observer")
            for name, value in (settings or {}).items():
                command += ["--" + name.replace("_", "-"), str(value)]
            self.nodes[node_id] = Node(node_id, http_port, raft_port, data_dir, self.root / f"node{node_id}.log",
                                       observer=node_id > voters, command=command, env=dict(base_env))
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


class SteadyWriter:
    """A background thread writing ``<prefix>/<n>`` = ``n`` one after another through any
    running node (following redirects, moving on to the next node on errors) and recording
    every acknowledged write. Used to check that no acknowledged write is ever lost.

        with SteadyWriter(cluster, "load") as writer:
            writer.wait_for_acks(20)
            ...
        writer.acked  # {key: (value, version)}
    """

    def __init__(self, cluster: Cluster, prefix: str, request_timeout_s: float = 5.0) -> None:
        self.cluster = cluster
        self.prefix = prefix
        self.request_timeout_s = request_timeout_s
        self.acked: dict[str, tuple[bytes, int]] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"writer-{prefix}", daemon=True)
        self._lock = threading.Lock()

    def __enter__(self) -> SteadyWriter:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=STOP_TIMEOUT_S + self.request_timeout_s)

    def ack_count(self) -> int:
        with self._lock:
            return len(self.acked)

    def wait_for_acks(self, count: int, timeout_s: float = DEFAULT_WAIT_S) -> None:
        """Block until ``count`` writes in total were acknowledged."""
        self.cluster.wait_until(lambda: self.ack_count() >= count, timeout_s,
                                f"{count} acknowledged writes (have {self.ack_count()}, errors {self.errors[-3:]})")

    def _run(self) -> None:
        sequence = 0
        turn = 0
        with httpx.Client(timeout=self.request_timeout_s) as client:
            while not self._stop.is_set():
                nodes = [node for node in self.cluster.nodes.values() if node.running() and not node.paused]
                if not nodes:
                    time.sleep(POLL_INTERVAL_S)
                    continue
                node = nodes[turn % len(nodes)]
                key = f"{self.prefix}/{sequence:06d}"
                value = str(sequence).encode()
                try:
                    response = client.put(f"{node.url}/v1/kv/{key}", content=value, follow_redirects=True)
                except httpx.HTTPError as exc:
                    self.errors.append(f"node {node.node_id}: {type(exc).__name__}")
                    turn += 1
                    time.sleep(POLL_INTERVAL_S)
                    continue
                if response.status_code == 200:
                    with self._lock:
                        self.acked[key] = (value, int(response.json()["version"]))
                else:
                    self.errors.append(f"node {node.node_id}: {response.status_code}")
                    turn += 1
                    time.sleep(POLL_INTERVAL_S)
                sequence += 1  # a new key every time: an unacknowledged one is never retried

    def max_version(self) -> int:
        with self._lock:
            return max((version for _, version in self.acked.values()), default=0)

    def missing_on(self, node: Node, consistency: str = "local") -> list[str]:
        """Acknowledged keys whose value ``node`` does not serve (after reaching max_version)."""
        target = self.max_version()
        client = self.cluster.client()
        missing = []
        with self._lock:
            acked = dict(self.acked)
        for key, (value, _version) in sorted(acked.items()):
            response = client.get(f"{node.url}/v1/kv/{key}",
                                  params={"consistency": consistency, "min_version": target, "wait_ms": 20000},
                                  timeout=30.0)
            if response.status_code != 200 or response.content != value:
                missing.append(f"{key}: {response.status_code} {response.content[:40]!r}")
        return missing


@pytest.fixture
def cluster_factory(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    """``cluster_factory(voters=3, observers=0, **kwargs)`` starts a Cluster under tmp_path;
    every cluster made is closed (its processes killed) at teardown. On a failed test the
    nodes' log tails are printed (pytest shows them with the failure)."""
    clusters: list[Cluster] = []

    def make(voters: int = 3, observers: int = 0, **kwargs: Any) -> Cluster:
        cluster = Cluster(tmp_path / f"cluster{len(clusters)}", voters, observers, **kwargs)
        clusters.append(cluster)
        return cluster.start()

    try:
        yield make
    finally:
        for cluster in clusters:
            print(cluster.logs())
            cluster.close()
