"""etcdctl (Debian's etcd-client) as the client: the same commands against a 3-voter metakv
cluster (through a follower) and a 3-member etcd started here, outputs compared after
normalising only ids, revisions and what docs/etcd.md lists as differing; then the same
JSON calls through both v3 gateways."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf import json_format

from app.etcd.protos import rpc_pb2, rpc_pb2_grpc
from loadtest.clusters import start_etcd
from loadtest.local_cluster import Cluster

pytestmark = pytest.mark.skipif(shutil.which("etcdctl") is None or shutil.which("etcd") is None,
                                reason="etcdctl and etcd come from `make system-etcd`")
COMMAND_TIMEOUT_S = 20
WATCH_WAIT_S = 10
# JSON members whose values name a cluster, member or point in time, not behaviour.
NUMBERED = {"cluster_id", "member_id", "revision", "raft_term", "create_revision", "mod_revision", "ID",
            "leader", "raftIndex", "raftTerm", "raftAppliedIndex", "compact_revision", "lease"}
# Members that differ by design (docs/etcd.md, Known differences).
DIFFERENT = {"dbSize", "dbSizeInUse", "name", "peerURLs", "clientURLs", "Endpoint"}
STATUS_DIFFERENT = DIFFERENT | {"version"}  # the server's version (a key's version is compared)

Etcdctl = Callable[..., str]


def normalised(value: Any, different: set[str] = DIFFERENT) -> Any:
    if isinstance(value, dict):
        return {key: ("N" if key in NUMBERED else normalised(item, different)) for key, item in value.items()
                if key not in different}
    if isinstance(value, list):
        return [normalised(item, different) for item in value]
    return value


def etcdctl_on(endpoint: str) -> Etcdctl:
    def run(*args: str, stdin: str | None = None) -> str:
        done = subprocess.run(["etcdctl", "--endpoints", endpoint, "--command-timeout=10s", *args], input=stdin,
                              capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        return done.stdout + done.stderr.split("Error: ")[-1] if done.returncode else done.stdout
    return run


def background_output(endpoint: str, args: list[str], lines: int) -> list[str]:
    """The first ``lines`` lines a long-running etcdctl command prints (then it is stopped)."""
    process = subprocess.Popen(["etcdctl", "--endpoints", endpoint, *args], stdout=subprocess.PIPE, text=True)
    try:
        output: list[str] = []
        deadline = time.monotonic() + WATCH_WAIT_S
        assert process.stdout is not None
        while len(output) < lines and time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            output.append(line.rstrip("\n"))
        return output
    finally:
        process.kill()
        process.wait()


def watch_output(endpoint: str, args: list[str], lines: int) -> list[str]:
    return background_output(endpoint, ["watch", *args], lines)


def lease_scenario(endpoint: str) -> dict[str, Any]:
    """etcdctl's lease commands and its lock and election recipes (leases, txns on
    create_revision, watches), lease ids and TTLs counted down replaced by placeholders."""
    run = etcdctl_on(endpoint)
    granted = run("lease", "grant", "60")
    lease = int(granted.split()[1], 16)

    def named(output: str) -> str:
        output = output.replace(f"{lease:016x}", "ID").replace(f"{lease:x}", "ID")
        return re.sub(r"remaining\(\d+s\)", "remaining(Ns)", output)

    seen: dict[str, Any] = {"lease grant": named(granted)}
    seen["put --lease"] = run("put", "leased", "v", f"--lease={lease:x}")
    seen["get leased -w json"] = normalised(json.loads(run("get", "leased", "-w", "json")))
    seen["lease timetolive --keys"] = named(run("lease", "timetolive", f"{lease:x}", "--keys"))
    seen["lease keep-alive --once"] = named(run("lease", "keep-alive", "--once", f"{lease:x}"))
    seen["lease list"] = named(run("lease", "list"))
    seen["lease revoke"] = named(run("lease", "revoke", f"{lease:x}"))
    seen["get after revoke"] = run("get", "leased")
    seen["lease revoke again"] = named(run("lease", "revoke", f"{lease:x}"))
    seen["lease timetolive gone"] = named(run("lease", "timetolive", f"{lease:x}"))
    seen["put --lease gone"] = run("put", "leased", "v", f"--lease={lease:x}")
    seen["lock"] = run("lock", "jobs", "echo", "held")
    seen["elect"] = [re.sub(r"/[0-9a-f]+$", "/ID", line)
                     for line in background_output(endpoint, ["elect", "leader", "me"], 2)]
    seen["elect --listen"] = [re.sub(r"/[0-9a-f]+$", "/ID", line)
                              for line in background_output(endpoint, ["elect", "--listen", "leader"], 2)]
    return seen


def scenario(endpoint: str) -> dict[str, Any]:
    """What etcdctl prints for each step of one session, revisions relative to its start."""
    run = etcdctl_on(endpoint)
    seen: dict[str, Any] = {}
    first = json.loads(run("put", "foo", "bar", "-w", "json"))["header"]["revision"]
    seen["put"] = run("put", "foo2", "baz")
    seen["get --prefix"] = run("get", "foo", "--prefix")
    seen["get -w json"] = normalised(json.loads(run("get", "foo", "-w", "json")))
    seen["put --prev-kv"] = run("put", "foo", "bar2", "--prev-kv")
    seen["get --rev"] = run("get", "foo", f"--rev={first}")
    seen["get --rev future"] = run("get", "foo", f"--rev={first + 1000}")
    seen["del"] = run("del", "foo2", "--prev-kv")
    seen["txn"] = run("txn", stdin='value("foo") = "bar2"\n\nput foo bar3\n\nput foo nope\n\n')
    seen["txn failing"] = run("txn", stdin='mod("foo") < "1"\n\nput foo never\n\nget foo\n\n')
    seen["get --from-key"] = run("get", "foo", "--from-key", "--keys-only")
    seen["get --sort"] = run("get", "", "--prefix", "--sort-by=MODIFY", "--order=DESCEND", "--keys-only")
    seen["watch --rev"] = watch_output(endpoint, ["--prefix", "foo", f"--rev={first}"], 9)
    seen["compaction"] = run("compaction", str(first)).replace(str(first), "R")
    seen["member list"] = normalised(json.loads(run("member", "list", "-w", "json")))
    seen["endpoint status"] = normalised(json.loads(run("endpoint", "status", "-w", "json")), STATUS_DIFFERENT)
    return seen


def gateway_session(base_url: str) -> dict[str, Any]:
    """The same calls as JSON through the v3 gateway: what a client of it reads back."""
    def post(path: str, body: dict[str, Any]) -> Any:
        answer = httpx.post(base_url + path, json=body, timeout=COMMAND_TIMEOUT_S)
        return answer.status_code, normalised(answer.json())

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode()

    seen: dict[str, Any] = {}
    seen["put"] = post("/v3/kv/put", {"key": b64(b"gw/a"), "value": b64(b"1")})
    seen["put prev_kv"] = post("/v3/kv/put", {"key": b64(b"gw/a"), "value": b64(b"2"), "prev_kv": True})
    post("/v3/kv/put", {"key": b64(b"gw/b"), "value": b64(b"3")})
    seen["range prefix"] = post("/v3/kv/range", {"key": b64(b"gw/"), "range_end": b64(b"gw0"), "limit": 1})
    seen["range count_only"] = post("/v3/kv/range", {"key": b64(b"gw/"), "range_end": b64(b"gw0"), "count_only": True})
    seen["txn"] = post("/v3/kv/txn", {
        "compare": [{"key": b64(b"gw/a"), "target": "VERSION", "result": "EQUAL", "version": 2}],
        "success": [{"request_range": {"key": b64(b"gw/b")}}, {"request_delete_range": {"key": b64(b"gw/b")}}]})
    seen["nested txn"] = post("/v3/kv/txn", {"success": [{"request_txn": {
        "compare": [{"key": b64(b"gw/a"), "target": "VALUE", "result": "EQUAL", "value": b64(b"2")}],
        "success": [{"request_range": {"key": b64(b"gw/"), "range_end": b64(b"gw0")}}, {"request_put": {
            "key": b64(b"gw/c"), "value": b64(b"4")}}]}}]})
    seen["duplicate key"] = post("/v3/kv/txn", {"success": [{"request_put": {"key": b64(b"gw/d")}},
                                                            {"request_txn": {"success": [{"request_put": {
                                                                "key": b64(b"gw/d")}}]}}]})
    seen["deleterange prev_kv"] = post("/v3/kv/deleterange", {"key": b64(b"gw/"), "range_end": b64(b"gw0"),
                                                              "prev_kv": True})
    seen["future revision"] = post("/v3/kv/range", {"key": b64(b"gw/a"), "revision": 100000})
    seen["empty key"] = post("/v3/kv/put", {"value": b64(b"v")})
    return seen


def relative(value: Any, base: int) -> Any:
    """``value`` with revisions counted from ``base`` and ids left out."""
    if isinstance(value, dict):
        return {key: int(item) - base if key in {"revision", "create_revision", "mod_revision"}
                else relative(item, base) for key, item in value.items()
                if key not in {"cluster_id", "member_id", "raft_term"}}
    if isinstance(value, list):
        return [relative(item, base) for item in value]
    return value


def nested_txn_session(endpoint: str) -> dict[str, Any]:
    """Txns with nested txns (etcdctl 3.4 cannot send them) over a raw gRPC stub: the
    answers, revisions relative to the session's first put."""
    def put(key: bytes) -> rpc_pb2.RequestOp:
        return rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key, value=b"v", prev_kv=True))

    def scan(key: bytes, range_end: bytes, delete: bool = False) -> rpc_pb2.RequestOp:
        if delete:
            return rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=key, range_end=range_end))
        return rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=key, range_end=range_end))

    def txn(compare: list[rpc_pb2.Compare], success: list[rpc_pb2.RequestOp],
            failure: list[rpc_pb2.RequestOp] | None = None) -> rpc_pb2.TxnRequest:
        return rpc_pb2.TxnRequest(compare=compare, success=success, failure=failure or [])

    def nest(request: rpc_pb2.TxnRequest) -> rpc_pb2.RequestOp:
        return rpc_pb2.RequestOp(request_txn=request)

    def value_is(key: bytes, value: bytes) -> rpc_pb2.Compare:
        return rpc_pb2.Compare(key=key, target=rpc_pb2.Compare.VALUE, result=rpc_pb2.Compare.EQUAL, value=value)

    requests = {
        "nested": txn([value_is(b"nt/a", b"1")], [scan(b"nt/a", b""), put(b"nt/b"), nest(txn(
            [value_is(b"nt/a", b"1"), value_is(b"nt/b", b"v")], [put(b"nt/c")], [scan(b"nt/", b"nt0"), put(b"nt/d")]))]),
        "failure branch": txn([value_is(b"nt/a", b"2")], [], [nest(txn([], [nest(txn([], [scan(b"nt/a", b"")]))]))]),
        "then and else put one key": txn([], [nest(txn([value_is(b"nt/e", b"x")], [put(b"nt/e")], [put(b"nt/e")]))]),
        "a later nested txn deletes a put": txn([], [nest(txn([], [put(b"nt/z")])),
                                                     nest(txn([], [scan(b"nt/", b"nt0", delete=True)]))]),
        "duplicate": txn([], [put(b"nt/k"), nest(txn([], [put(b"nt/k")]))]),
        "delete then put": txn([], [nest(txn([], [scan(b"nt/k", b"", delete=True)])), put(b"nt/k")]),
    }
    with grpc.insecure_channel(endpoint) as channel:
        kv = rpc_pb2_grpc.KVStub(channel)
        base = kv.Put(rpc_pb2.PutRequest(key=b"nt/a", value=b"1"), timeout=COMMAND_TIMEOUT_S).header.revision
        seen: dict[str, Any] = {}
        for name, request in requests.items():
            try:
                answer = kv.Txn(request, timeout=COMMAND_TIMEOUT_S)
            except grpc.RpcError as exc:
                seen[name] = (exc.code(), exc.details())
                continue
            seen[name] = relative(json_format.MessageToDict(answer, preserving_proto_field_name=True), base)
    return seen


@pytest.fixture
def clusters(tmp_path: Path) -> Iterator[tuple[Cluster, Any]]:
    metakv = Cluster(tmp_path / "metakv", 3, etcd=True)
    etcd = None
    try:
        metakv.start()
        etcd = start_etcd(3, tmp_path / "etcd")
        yield metakv, etcd
    finally:
        if etcd is not None:
            for member in etcd.nodes.values():  # SIGKILL: a graceful etcd stop takes seconds
                member.kill()
        print(metakv.logs())
        metakv.close()


def test_etcdctl_prints_the_same_against_metakv_and_etcd(clusters: tuple[Cluster, Any]) -> None:
    metakv, etcd = clusters
    leader = metakv.wait_for_leader()
    follower = next(node for node in metakv.voters if node.node_id != leader.node_id)
    expected = scenario(next(iter(etcd.nodes.values())).url)
    assert expected["txn"] == "SUCCESS\n\nOK\n" and expected["watch --rev"][:3] == ["PUT", "foo", "bar"]
    got = scenario(f"127.0.0.1:{follower.etcd_port}")  # a follower forwards the writes
    for key in expected:
        assert (key, got[key]) == (key, expected[key])
    expected_leases = lease_scenario(next(iter(etcd.nodes.values())).url)
    assert expected_leases["lease grant"] == "lease ID granted with TTL(60s)\n"
    got_leases = lease_scenario(f"127.0.0.1:{follower.etcd_port}")
    for key in expected_leases:
        assert (key, got_leases[key]) == (key, expected_leases[key])
    # every member's etcd client URL, as etcd lists them (asked of a follower)
    listed = json.loads(etcdctl_on(f"127.0.0.1:{follower.etcd_port}")("member", "list", "-w", "json"))
    assert {member["ID"]: member["clientURLs"] for member in listed["members"]} == {
        node.node_id: [f"http://127.0.0.1:{node.etcd_port}"] for node in metakv.nodes.values()}
    expected_nested = nested_txn_session(next(iter(etcd.nodes.values())).url.removeprefix("http://"))
    assert expected_nested["duplicate"][1] == "etcdserver: duplicate key given in txn request"
    got_nested = nested_txn_session(f"127.0.0.1:{follower.etcd_port}")
    for key in expected_nested:
        assert (key, got_nested[key]) == (key, expected_nested[key])
    expected_json = gateway_session(next(iter(etcd.nodes.values())).url)
    got_json = gateway_session(f"http://127.0.0.1:{follower.etcd_gateway_port}")
    for key in expected_json:
        assert (key, got_json[key]) == (key, expected_json[key])
