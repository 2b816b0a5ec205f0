"""The metakv command line: bad input is one line and exit code 2; cluster up and status work."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.cli import main
from tests.cluster import REPO_ROOT, Cluster, Node, free_ports

VALID = ["--node-id", "1", "--data-dir", "DATA", "--listen-http", "127.0.0.1:1",
         "--listen-raft", "127.0.0.1:2", "--voters", "1@127.0.0.1:2"]


def run_cli(args: list[str], env: dict[str, str] | None = None, timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
    base = {key: value for key, value in os.environ.items() if not key.startswith("METAKV_")}
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True,
                          env={**base, **(env or {})}, cwd=REPO_ROOT, timeout=timeout_s)


def with_flag(flag: str, value: str | None) -> list[str]:
    """VALID serve flags with ``flag`` replaced (value None: removed)."""
    args = list(VALID)
    if flag in args:
        index = args.index(flag)
        del args[index:index + 2]
    if value is not None:
        args += [flag, value]
    return ["serve", *args]


@pytest.mark.parametrize(("args", "mentions"), [
    (["frobnicate"], "invalid choice"),
    ([], "required"),
    (["serve", "--no-such-flag"], "--no-such-flag"),
    (with_flag("--node-id", None), "--node-id"),
    (with_flag("--node-id", "one"), "--node-id"),
    (with_flag("--node-id", "7"), "not in --voters"),
    (with_flag("--voters", "1@127.0.0.1"), "--voters"),
    (with_flag("--voters", "1@h:1,1@h:2"), "twice"),
    (with_flag("--listen-http", "nowhere"), "--listen-http"),
    (with_flag("--listen-raft", "127.0.0.1:70000"), "--listen-raft"),
    (with_flag("--advertise-http", "ftp://x"), "--advertise-http"),
    (with_flag("--election-timeout-ms", "-5"), "--election-timeout-ms"),
    (with_flag("--config", "/no/such/file.toml"), "--config"),
    (["cluster", "up", "--voters", "zero"], "--voters"),
    (["status", "--url", "not-a-url"], "--url"),
])
def test_bad_flags_exit_2_with_one_line(args: list[str], mentions: str, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [key for key in os.environ if key.startswith("METAKV_")]:
        monkeypatch.delenv(key)
    assert main(args) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert mentions in lines[0]
    assert captured.out == ""


def test_bad_flags_exit_code_of_the_process_is_2() -> None:
    result = run_cli(with_flag("--voters", "1@h"))
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "--voters" in result.stderr


def test_bad_environment_and_config_file_exit_2(tmp_path: Path) -> None:
    result = run_cli(["serve", *VALID[:-2]], env={"METAKV_VOTERS": "garbage"})
    assert result.returncode == 2
    assert "METAKV_VOTERS" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("node_id = [\n")
    result = run_cli(["serve", "--config", str(bad_toml)])
    assert result.returncode == 2 and "not valid TOML" in result.stderr
    unknown = tmp_path / "unknown.toml"
    unknown.write_text('node_id = 1\ncolour = "blue"\n')
    result = run_cli(["serve", "--config", str(unknown)])
    assert result.returncode == 2 and "colour" in result.stderr


class ClusterUpRun:
    """A running `metakv cluster up`: everything it printed, read by a thread as it comes."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self.lines.append("")  # end of output
            self._changed.notify_all()

    def wait_for_line(self, text: str, timeout_s: float = 60) -> str:
        """The first line containing ``text``; empty if the output ends or time runs out first."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                for line in self.lines:
                    if text in line:
                        return line
                if (self.lines and self.lines[-1] == "") or time.monotonic() > deadline:
                    return ""
                self._changed.wait(timeout=max(0.01, deadline - time.monotonic()))

    @property
    def output(self) -> str:
        with self._changed:
            return "".join(self.lines)

    def node_pids(self) -> list[int]:
        """The children's pids, from the banner."""
        return [int(pid) for pid in re.findall(r"^  node \d+ .* pid (\d+)$", self.output, re.MULTILINE)]


@contextlib.contextmanager
def cluster_up(args: list[str], env: dict[str, str]) -> Iterator[tuple[subprocess.Popen[str], str, ClusterUpRun]]:
    """Run `metakv cluster up ARGS` until it prints its leader line; yield the process,
    everything it printed up to there, and the run (to read later lines); SIGTERM it on the
    way out (SIGKILL its group if it does not stop within 40 s, and any node it left behind).
    The caller checks its return code."""
    if "--base-etcd-port" not in args:  # the defaults (2379, 12379) are fixed ports: none unless asked
        args = [*args, "--base-etcd-port", "0", "--base-etcd-gateway-port", "0"]
    process = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "cluster", "up", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT, start_new_session=True,
        env=env,
    )
    run = ClusterUpRun(process)
    try:
        run.wait_for_line("leader:")
        yield process, run.output, run
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        for pid in run.node_pids():  # nodes have their own sessions: a supervisor that died leaves them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_cluster_up_serves_and_status_prints_the_quorum_table(tmp_path: Path) -> None:
    """`cluster up` starts 3 voters + 1 observer, prints URLs and curl examples; `status` prints
    the quorum table; a node stopped by its pid leaves the others running; SIGHUP stops every
    node."""
    http_base, raft_base = _port_ranges(4)
    etcd_base, gateway_base = _port_ranges(4)
    with cluster_up(["--base-http-port", str(http_base), "--base-raft-port", str(raft_base),
                     "--base-etcd-port", str(etcd_base), "--base-etcd-gateway-port", str(gateway_base),
                     "--data-dir", str(tmp_path / "data")],
                    {**os.environ, "METAKV_CLUSTER_ID": f"cli-test-{uuid.uuid4().hex[:12]}"}) as (process, text, run):
        assert "leader:" in text, text
        for node_id in range(4):
            assert f"http://127.0.0.1:{http_base + node_id}" in text
        assert "curl -L -X PUT" in text and "observer" in text
        assert f"etcdctl --endpoints 127.0.0.1:{etcd_base},127.0.0.1:{etcd_base + 1}," in text
        first = f"http://127.0.0.1:{http_base}"
        response = httpx.put(f"{first}/v1/kv/cli/a", content=b"x", follow_redirects=True, timeout=10)
        assert response.status_code == 200
        # The observer's gateway. An observer that has not yet heard the leader since its start
        # answers UNAVAILABLE (14), which etcd clients retry: so does this test, for a bounded time.
        for _ in range(50):
            etcd_read = httpx.post(f"http://127.0.0.1:{gateway_base + 3}/v3/kv/range",
                                   json={"key": base64.b64encode(b"cli/a").decode()}, timeout=10).json()
            if etcd_read.get("code") != 14:
                break
            time.sleep(0.2)
        assert "kvs" in etcd_read, etcd_read
        assert base64.b64decode(etcd_read["kvs"][0]["value"]) == b"x"
        status = run_cli(["status", "--url", first])
        assert status.returncode == 0, status.stderr
        table = status.stdout.splitlines()
        assert table[1].split()[:3] == ["NODE", "KIND", "ROLE"]
        rows = [line.split() for line in table[2:]]
        assert sorted(int(row[0]) for row in rows) == [1, 2, 3, 4]
        assert sum(row[2] == "leader" for row in rows) == 1
        assert [row[1] for row in rows].count("observer") == 1
        # The banner's status command works pasted into a shell anywhere, venv not activated
        # (it printed a bare `metakv`: "command not found" after `make run`).
        pasted = [line.strip() for line in text.splitlines() if line.strip().endswith(f"status --url {first}")]
        assert len(pasted) == 1, text
        shell_env = {key: value for key, value in os.environ.items() if not key.startswith(("METAKV_", "VIRTUAL_ENV"))}
        shell_env["PATH"] = "/usr/bin:/bin"
        status = subprocess.run(["/bin/sh", "-c", pasted[0]], capture_output=True, text=True, cwd=tmp_path,
                                env=shell_env, timeout=30)
        assert status.returncode == 0, (pasted[0], status.stderr)
        assert status.stdout.splitlines()[1].split()[:3] == ["NODE", "KIND", "ROLE"]
        # A user tries a failover by stopping one node by the pid the banner printed: that node
        # is reported in one line, the others keep serving, the supervisor keeps running.
        pids = run.node_pids()
        assert len(pids) == 4, text
        os.kill(pids[3], signal.SIGTERM)  # node 4, the observer
        line = run.wait_for_line("node 4 exited")
        assert line.strip() == "node 4 exited with code 0; 3 of 4 nodes still running (Ctrl-C stops the cluster)", \
            run.output
        for node_id in range(3):
            assert httpx.get(f"http://127.0.0.1:{http_base + node_id}/healthz", timeout=5).status_code == 200
        assert process.poll() is None, run.output
        # Closing the terminal (SIGHUP) stops every node, as Ctrl-C does (it used to kill only
        # the supervisor and leave the nodes running in their own sessions).
        process.send_signal(signal.SIGHUP)
        process.wait(timeout=40)
    assert process.returncode == 0, run.output
    for node_id in range(4):  # every node stopped with the supervisor
        try:
            httpx.get(f"http://127.0.0.1:{http_base + node_id}/healthz", timeout=1)
            raise AssertionError(f"node {node_id + 1} still serving after cluster up stopped")
        except httpx.TransportError:
            pass


def test_serve_takes_every_setting_from_environment_and_toml(tmp_path: Path) -> None:
    http_port, raft_port = free_ports(2)
    config = tmp_path / "node.toml"
    config.write_text(f'[serve]\nlisten_raft = "127.0.0.1:{raft_port}"\nvoters = "1@127.0.0.1:{raft_port}"\n'
                      f'data_dir = "{tmp_path / "data"}"\n')
    cluster = Cluster(tmp_path / "unused", voters=0)
    env = {key: value for key, value in os.environ.items() if not key.startswith("METAKV_")}
    env.update(METAKV_CLUSTER_ID=f"cli-env-{uuid.uuid4().hex[:12]}", METAKV_NODE_ID="1", METAKV_LISTEN_HTTP=f"127.0.0.1:{http_port}", METAKV_CONFIG=str(config),
               PYTHONUNBUFFERED="1")
    node = Node(1, http_port, raft_port, tmp_path / "data", tmp_path / "node.log",
                command=[sys.executable, "-m", "app.cli", "serve"], env=env)
    cluster.nodes = {1: node}
    try:
        cluster.start()
        assert cluster.wait_for_leader().node_id == 1  # a single voter elects itself
        response = cluster.put("env/k", b"v")
        assert response.status_code == 200
        assert cluster.status(node)["advertise_http"] == f"http://127.0.0.1:{http_port}"
        # SIGHUP (documented as "reload tokens") without an auth file: one log line, the node
        # keeps serving; it used to die on the signal's default action.
        node.signal(signal.SIGHUP)
        logged = "SIGHUP: no auth file configured, nothing to reload"
        cluster.wait_until(lambda: logged in node.log_tail() or not node.running(), what="the SIGHUP log line")
        assert node.running(), f"SIGHUP killed the node:\n{node.log_tail()}"
        assert node.log_tail().count(logged) == 1
        assert cluster.put("env/k2", b"v").status_code == 200
        assert node.stop() == 0  # still a graceful shutdown on SIGTERM
    finally:
        print(cluster.logs())
        cluster.close()


def _port_ranges(count: int) -> tuple[int, int]:
    """Two runs of ``count`` consecutive free ports (cluster up numbers ports from a base)."""
    for _ in range(50):
        base = free_ports(1)[0]
        if base + 2 * count >= 65535:
            continue
        candidates = list(range(base, base + 2 * count))
        sockets: list[socket.socket] = []
        try:
            for port in candidates:
                sock = socket.socket()
                sock.bind(("127.0.0.1", port))
                sockets.append(sock)
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
        return base, base + count
    raise AssertionError("no run of free ports found")


def test_cluster_up_with_an_auth_file_enforces_it_on_every_node(tmp_path: Path) -> None:
    """`cluster up --auth-file` starts every node with the token file, finds the leader with
    `--token`, and tells the user how to pass a token; requests without one answer 401."""
    token = "cli-" + uuid.uuid4().hex
    auth_file = tmp_path / "tokens.toml"
    auth_file.write_text(f'[[tokens]]\nname = "ops"\nsha256 = "{hashlib.sha256(token.encode()).hexdigest()}"\n'
                         'rules = { "" = "admin" }\n')
    http_base, raft_base = _port_ranges(3)
    etcd_base, _ = _port_ranges(3)
    with cluster_up(["--voters", "3", "--observers", "0", "--base-http-port", str(http_base),
                     "--base-raft-port", str(raft_base), "--data-dir", str(tmp_path / "data"),
                     "--base-etcd-port", str(etcd_base), "--auth-file", str(auth_file), "--token", token],
                    {**{k: v for k, v in os.environ.items() if not k.startswith("METAKV_")},
                     "METAKV_CLUSTER_ID": f"cli-auth-{uuid.uuid4().hex[:12]}"}) as (process, text, run):
        assert "leader: http://" in text and "auth is on" in text, text
        first = f"http://127.0.0.1:{http_base}"
        for node in range(3):
            url = f"http://127.0.0.1:{http_base + node}/v1/kv/cli/a"
            assert httpx.get(url, timeout=10).status_code == 401
        bearer = {"Authorization": f"Bearer {token}"}
        leader = text.split("leader: ", 1)[1].split()[0]
        assert httpx.put(f"{leader}/v1/kv/cli/a", content=b"x", headers=bearer, timeout=10).status_code == 200
        status = run_cli(["status", "--url", first], env={"METAKV_TOKEN": token})
        assert status.returncode == 0, status.stderr
        # The etcd port serves too, with the same tokens (docs/etcd.md, Auth).
        etcdctl = ["etcdctl", f"--endpoints=127.0.0.1:{etcd_base}", "--command-timeout=10s"]
        got = subprocess.run([*etcdctl, f"--user=ops:{token}", "get", "cli/a"], capture_output=True, text=True)
        assert got.stdout.splitlines() == ["cli/a", "x"], got.stderr
        anonymous = subprocess.run([*etcdctl, "get", "cli/a"], capture_output=True, text=True)
        assert "etcdserver: user name is empty" in anonymous.stderr
    assert process.returncode == 0  # stopped by SIGTERM, which stops every node too
    for node in range(3):
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{http_base + node}/healthz", timeout=1)


def test_cluster_up_with_a_bad_auth_file_exits_2_before_starting_nodes(tmp_path: Path) -> None:
    bad = tmp_path / "tokens.toml"
    bad.write_text("[[tokens]\n")
    result = run_cli(["cluster", "up", "--data-dir", str(tmp_path / "data"), "--auth-file", str(bad)])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "--auth-file" in lines[0] and "TOML" in lines[0], result.stderr
    assert not (tmp_path / "data").exists()


class _FakeNode:
    """A loopback HTTP server answering /healthz and /v1/status like a node in ``role``."""

    def __init__(self, port: int, role: str) -> None:
        import http.server
        import json
        import threading

        self.healthz_hits = 0
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path == "/healthz":
                    fake.healthz_hits += 1
                body = json.dumps({"role": role, "ok": True}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_cluster_up_prints_the_leader_only_once_every_node_serves_http() -> None:
    """A quorum can elect a leader while the third node is still starting: the leader line
    (after which the user curls every URL of the banner) waits for that node too."""
    from app.cli import _wait_for_leader

    leader_port, late_port = free_ports(2)
    leader = _FakeNode(leader_port, "leader")
    late: list[_FakeNode] = []
    started = time.monotonic()
    try:
        def stop() -> bool:
            if not late and time.monotonic() - started > 1.0:
                late.append(_FakeNode(late_port, "follower"))
            return False

        found = _wait_for_leader([f"http://127.0.0.1:{leader_port}", f"http://127.0.0.1:{late_port}"], stop)
        assert found == f"http://127.0.0.1:{leader_port}"
        assert late and late[0].healthz_hits >= 1, "the leader line came before the late node served"
    finally:
        leader.close()
        for node in late:
            node.close()


def test_the_banner_names_the_running_metakv_script_by_its_absolute_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`make run` starts `.venv/bin/metakv cluster up` (a relative path, venv not activated):
    the banner's status command is that script's absolute path."""
    from app.cli import _print_banner

    script = tmp_path / "my venv" / "bin" / "metakv"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["my venv/bin/metakv", "cluster", "up"])

    class Child:
        pid = 4242

    _print_banner([(1, "http://127.0.0.1:8001", Child())], voters=1, auth=False)  # type: ignore[list-item]
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    assert f"'{script}' status --url http://127.0.0.1:8001" in lines
