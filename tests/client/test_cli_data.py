"""The data commands of `metakv` (app/cli_data.py), run in-process against real nodes: output
formats, exit codes, and a snapshot saved under writes, restored and served."""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.auth import hash_token
from app.cli import main
from app.cli_data import add_data_commands
from loadtest.local_cluster import Node, free_ports
from metakv import Client, Forbidden, RetryPolicy, Unauthorized
from tests.cluster import Cluster, SteadyWriter

FAST = {"election_timeout_ms": 500, "fetch_timeout_ms": 1000, "fetch_max_wait_ms": 200}
PATIENT = RetryPolicy(deadline_s=30.0)


class Run:
    """``metakv ARGS`` in-process: (exit code, stdout, stderr)."""

    def __init__(self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
        self.capsys = capsys
        self.monkeypatch = monkeypatch

    def __call__(self, *args: str, stdin: bytes = b"") -> tuple[int, str, str]:
        self.monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
        code = main(list(args))
        captured = self.capsys.readouterr()
        return code, captured.out, captured.err


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Run:
    for name in ("METAKV_ENDPOINTS", "METAKV_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return Run(capsys, monkeypatch)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One single-voter node for the output and exit-code cases."""
    with Cluster(tmp_path_factory.mktemp("cli"), voters=1, settings=FAST) as cluster:
        yield cluster.wait_for_leader().url


def test_put_get_list_del_in_each_output_format(node: str, run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METAKV_ENDPOINTS", node)
    code, out, _ = run("put", "cfg/db", "postgres://db")
    written = json.loads(out)
    assert code == 0 and written["key"] == "cfg/db" and written["created"] is True
    assert run("put", "cfg/blob", "--content-type", "application/octet-stream", "-o", "value",
               stdin=b"\xff\x00raw")[:2] == (0, f"{written['version'] + 1}\n")
    code, out, _ = run("get", "cfg/db")
    assert code == 0 and json.loads(out) == {"key": "cfg/db", "value": "postgres://db", "content_type":
                                              "text/plain; charset=utf-8", "mod_version": written["version"],
                                              "create_version": written["version"]}
    assert run("get", "cfg/db", "--output", "value")[1] == "postgres://db"
    table = run("get", "cfg/blob", "-o", "table")[1].splitlines()
    assert table[0].split() == ["KEY", "MOD_VERSION", "CREATE_VERSION", "CONTENT_TYPE", "VALUE"]
    assert table[1].split()[0] == "cfg/blob" and table[1].endswith("<5 bytes>")
    code, out, _ = run("list", "cfg/", "--keys-only")
    assert [item["key"] for item in json.loads(out)["items"]] == ["cfg/blob", "cfg/db"]
    assert "value" not in json.loads(out)["items"][0]
    cut = json.loads(run("list", "cfg/", "--limit", "1")[1])
    assert [item["key"] for item in cut["items"]] == ["cfg/blob"] and cut["next"] == "cfg/blob"  # more to come
    assert json.loads(out)["next"] is None
    code, out, _ = run("del", "cfg/blob")
    assert code == 0 and json.loads(out)["deleted"] is True
    assert run("list", "cfg/", "-o", "value")[1] == "postgres://db\n"


def test_watch_and_txn(node: str, run: Run) -> None:
    first = json.loads(run("put", "w/a", "1", "--endpoints", node)[1])["version"]
    run("put", "w/a", "2", "--endpoints", node)
    code, out, _ = run("watch", "w/", "--since", str(first - 1), "--count", "2", "--endpoints", node)
    assert code == 0 and [json.loads(line)["value"] for line in out.splitlines()] == ["1", "2"]
    header, row, _ = run("watch", "w/", "--since", str(first - 1), "--count", "2", "-o", "table",
                         "--endpoints", node)[1].splitlines()
    assert [header.index(name) for name in ("MOD_VERSION", "KEY")] == [row.index(str(first)), row.index("w/a")]
    body = {"compare": [{"key": "w/a", "value": "2"}], "success": [{"op": "put", "key": "w/b", "value": "x"}],
            "failure": [{"op": "get", "key": "w/a"}]}
    code, out, _ = run("txn", "--endpoints", node, stdin=json.dumps(body).encode())
    result = json.loads(out)
    assert code == 0 and result["succeeded"] is True and result["results"] == [
        {"op": "put", "key": "w/b", "created": True}]


def test_a_cluster_error_exits_1_with_the_problems_title(node: str, run: Run) -> None:
    run("put", "e/a", "1", "--endpoints", node)
    code, out, err = run("put", "e/a", "2", "--if-version", "1", "--endpoints", node)
    assert (code, out) == (1, "") and err.startswith("metakv: Precondition failed: ") and err.count("\n") == 1
    code, _, err = run("put", "e/a", "3", "--create", "--endpoints", node)
    assert code == 1 and err.startswith("metakv: Precondition failed")
    assert run("get", "e/missing", "--endpoints", node)[::2] == (1, "metakv: Key not found: 'e/missing'\n")
    [port] = free_ports(1)
    code, _, err = run("get", "e/a", "--endpoints", f"http://127.0.0.1:{port}", "--timeout-ms", "300")
    assert code == 1 and err.startswith("metakv: Cluster unavailable: ") and err.count("\n") == 1


@pytest.mark.parametrize(("args", "stdin", "expected"), [
    (("get", ""), b"", "KEY: must be non-empty"),
    (("list", "--output", "yaml"), b"", "--output: expected one of json, table, value"),
    (("get", "k", "--endpoints", "ftp://x"), b"", "--endpoints: expected an http:// or https:// URL"),
    (("put", "k", "v", "--if-version", "x"), b"", "--if-version: expected an integer"),
    (("get", "k", "--consistency", "eventual"), b"", "--consistency: expected one of local, leader, linearizable"),
    (("txn",), b"{not json", "txn: the body is not JSON"),
    (("txn",), b'{"compare": 5}', 'txn: expected a JSON object with "compare", "success" and "failure" lists'),
    (("watch", "--since", "-1"), b"", "--since: -1 is outside"),
    (("put", "k", "v", "--bogus"), b"", "unrecognized arguments: --bogus"),
])
def test_bad_input_exits_2_with_one_line(run: Run, args: tuple[str, ...], stdin: bytes, expected: str) -> None:
    endpoints = () if "--endpoints" in args else ("--endpoints", "http://127.0.0.1:1")
    code, out, err = run(*args, *endpoints, stdin=stdin)
    assert (code, out) == (2, "") and expected in err and err.count("\n") == 1, err


def test_restore_refuses_a_file_that_is_not_a_snapshot_and_a_directory_in_use(tmp_path: Path, run: Run) -> None:
    junk = tmp_path / "junk.snapshot"
    junk.write_bytes(b"x" * 100)
    code, _, err = run("snapshot", "restore", str(junk), "--data-dir", str(tmp_path / "new"))
    assert code == 2 and "not a metakv snapshot" in err and not (tmp_path / "new").exists()
    code, _, err = run("snapshot", "restore", str(junk), "--data-dir", str(tmp_path))
    assert code == 2 and "exists and is not empty" in err


def test_snapshot_saved_under_writes_restores_to_exactly_its_version(
        cluster_factory: Callable[..., Cluster], tmp_path: Path, run: Run) -> None:
    cluster = cluster_factory(voters=3, settings=FAST)
    endpoints = ",".join(node.url for node in cluster.voters)
    backup = tmp_path / "backup.snapshot"
    with SteadyWriter(cluster, "snap") as writer:
        writer.wait_for_acks(30)
        code, out, err = run("snapshot", "save", str(backup), "--endpoints", endpoints)
        assert code == 0, err
        version = json.loads(out)["version"]
        writer.wait_for_acks(writer.ack_count() + 20)  # writes went on after the snapshot
    assert any(acked > version for _, acked in writer.acked.values())
    with Client(endpoints, retry=PATIENT) as kv:
        expected = kv.list("snap/", at_version=version)
    assert expected.version == version and expected.items

    restored_dir = tmp_path / "restored"
    code, out, err = run("snapshot", "restore", str(backup), "--data-dir", str(restored_dir))
    assert code == 0 and f"restored version {version}" in out, err
    http_port, raft_port = free_ports(2)
    env = {key: value for key, value in os.environ.items() if not key.startswith("METAKV_")}
    restored = Node(1, http_port, raft_port, restored_dir, tmp_path / "restored.log", env={
        **env, "METAKV_CLUSTER_ID": "restored", "METAKV_CLUSTER_SECRET": "restored-secret"}, command=[
        sys.executable, "-m", "app.cli", "serve", "--node-id", "1", "--data-dir", str(restored_dir),
        "--listen-http", f"127.0.0.1:{http_port}", "--listen-raft", f"127.0.0.1:{raft_port}",
        "--voters", f"1@127.0.0.1:{raft_port}"])
    try:
        restored.start()
        with Client(restored.url, retry=PATIENT) as kv:
            served = kv.list("snap/")
            assert served.items == expected.items  # keys, values, versions: the state at the snapshot
            assert kv.put("after/restore", "ok").version > version  # and it serves writes on top
    finally:
        restored.kill()
        print(restored.log_tail())


def test_a_token_follows_the_redirect_and_refusals_are_typed(cluster_factory: Callable[..., Cluster],
                                                              tmp_path: Path, run: Run,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Auth on: the token goes with the write redirected to the leader (httpx alone would
    drop it on the redirect); a missing token is Unauthorized, a read-only one Forbidden;
    the CLI takes the token from METAKV_TOKEN."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text("".join(f'[[tokens]]\nname = "{name}"\nsha256 = "{hash_token(name + "-secret")}"\n'
                              f'rules = {{ "" = "{access}" }}\n' for name, access in (("ops", "admin"),
                                                                                      ("reader", "read"))))
    cluster = cluster_factory(voters=3, settings={**FAST, "auth_file": tokens}, token="ops-secret")
    leader = cluster.wait_for_leader()
    follower_first = [node.url for node in cluster.voters if node is not leader] + [leader.url]
    with Client(follower_first, token="ops-secret") as kv:
        assert kv.put("a/k", "v").version > 0
        assert kv.endpoints.leader_url == leader.url
    with Client(follower_first) as anonymous, pytest.raises(Unauthorized):
        anonymous.get("a/k")
    with Client(follower_first, token="reader-secret") as reader:
        assert reader.get("a/k").text == "v"  # type: ignore[union-attr]
        with pytest.raises(Forbidden):
            reader.put("a/k", "w")
    monkeypatch.setenv("METAKV_TOKEN", "reader-secret")
    assert run("get", "a/k", "-o", "value", "--endpoints", ",".join(follower_first))[:2] == (0, "v")
    code, _, err = run("put", "a/k", "w", "--endpoints", ",".join(follower_first))
    assert code == 1 and err.startswith("metakv: Forbidden")


def test_dot_segments_are_part_of_the_key(node: str, run: Run) -> None:
    """``a/../b`` is a key of its own, not a path that resolves to ``b``."""
    assert json.loads(run("put", "dots/../b", "1", "--endpoints", node)[1])["key"] == "dots/../b"
    assert json.loads(run("put", "dots/.", "2", "--endpoints", node)[1])["key"] == "dots/."
    assert run("get", "dots/../b", "-o", "value", "--endpoints", node)[1] == "1"
    listing = json.loads(run("list", "dots/", "--keys-only", "--endpoints", node)[1])
    assert [item["key"] for item in listing["items"]] == ["dots/.", "dots/../b"]
    assert run("get", "b", "--endpoints", node)[0] == 1


class ClosedPipe(io.RawIOBase):
    """stdout whose reader went away (``metakv list | head -1``)."""

    def writable(self) -> bool:
        return True

    def write(self, data: object) -> int:
        raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.parametrize("output", ["json", "value", "table"])
def test_a_reader_that_goes_away_ends_the_command_quietly(node: str, run: Run, output: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    run("put", "pipe/a", "1", "--endpoints", node)
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BufferedWriter(ClosedPipe())))
    code, _, err = run("list", "pipe/", "-o", output, "--endpoints", node)
    assert (code, err) == (141, "")


def test_every_argument_of_the_data_commands_is_explained() -> None:
    commands = argparse.ArgumentParser(prog="metakv").add_subparsers(dest="command")
    add_data_commands(commands)
    snapshot = commands.choices["snapshot"]
    [snapshot_actions] = [action for action in snapshot._actions if isinstance(action, argparse._SubParsersAction)]
    for command in [*(commands.choices[name] for name in ("get", "put", "del", "list", "watch", "txn")),
                    *snapshot_actions.choices.values()]:
        unexplained = [action.dest for action in command._actions if not action.help]
        assert not unexplained, (command.prog, unexplained)
    put_help = " ".join(commands.choices["put"].format_help().split())
    assert "application/octet-stream for stdin" in put_help  # what a value from stdin is stored as


def test_restore_into_a_directory_that_cannot_be_made_exits_2_with_one_line(node: str, run: Run,
                                                                            tmp_path: Path) -> None:
    backup = tmp_path / "backup.snapshot"
    run("put", "r/a", "1", "--endpoints", node)
    assert run("snapshot", "save", str(backup), "--endpoints", node)[0] == 0
    (tmp_path / "a-file").write_text("")
    code, out, err = run("snapshot", "restore", str(backup), "--data-dir", str(tmp_path / "a-file" / "new"))
    assert (code, out) == (2, "") and "Not a directory" in err and err.count("\n") == 1, err
    code, _, err = run("snapshot", "restore", str(tmp_path), "--data-dir", str(tmp_path / "new"))
    assert code == 2 and f"{tmp_path}: not a file" in err
