"""etcd's auth on the etcd port, mapped onto the token file (app/etcd/access.py), against an
in-process node: Authenticate(name, secret), the HTTP API's per-prefix rules on gRPC and the
gateway, etcd's error codes and messages, and the audit log's lines."""

from __future__ import annotations

import base64
import hashlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from app.auth import AuthTokens, load_auth_policy
from app.etcd.mapping import EtcdMapping, prefix_end
from app.etcd.protos import rpc_pb2, rpc_pb2_grpc
from app.etcd.serve import EtcdApi
from tests.http.service_double import InProcessService

pytestmark = pytest.mark.anyio
WAIT_S = 10
TOKENS = {"ops": ("ops-secret", '"" = "admin"'),
          "reader": ("reader-secret", '"app/" = "read"\n"app/private/" = "deny"'),
          "writer": ("writer-secret", '"app/" = "write"')}


@dataclass
class Port:
    api: EtcdApi
    channel: grpc.aio.Channel

    def kv(self) -> rpc_pb2_grpc.KVStub:
        return rpc_pb2_grpc.KVStub(self.channel)


def as_user(name: str) -> tuple[tuple[str, str], ...]:
    return (("token", TOKENS[name][0]),)


@pytest.fixture
async def port(service: InProcessService, tmp_path: Path) -> AsyncIterator[Port]:
    path = tmp_path / "tokens.toml"
    path.write_text("".join(f'[[tokens]]\nname = "{name}"\nsha256 = "{hashlib.sha256(secret.encode()).hexdigest()}"\n'
                            f"[tokens.rules]\n{rules}\n" for name, (secret, rules) in TOKENS.items()))
    api = EtcdApi(EtcdMapping(service, "test-cluster", {1: []}), "127.0.0.1", 0,
                  tokens=AuthTokens(load_auth_policy(path)))
    await api.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{api.port}")
    try:
        yield Port(api, channel)
    finally:
        await channel.close()
        await api.stop()


async def refused(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call  # type: ignore[misc]
    return raised.value


async def test_authenticate_answers_the_secret_for_a_name_and_its_secret(port: Port,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="metakv.audit")
    auth = rpc_pb2_grpc.AuthStub(port.channel)
    answer = await auth.Authenticate(rpc_pb2.AuthenticateRequest(name="writer", password="writer-secret"),
                                     timeout=WAIT_S)
    put = await port.kv().Put(rpc_pb2.PutRequest(key=b"app/a", value=b"1"), metadata=(("token", answer.token),),
                              timeout=WAIT_S)
    assert put.header.revision > 0
    for name, password in (("writer", "reader-secret"), ("nobody", "writer-secret"), ("writer", "")):
        wrong = await refused(auth.Authenticate(rpc_pb2.AuthenticateRequest(name=name, password=password),
                                                timeout=WAIT_S))
        assert (wrong.code(), wrong.details()) == (
            grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: authentication failed, invalid user ID or password")
    audited = [record.getMessage() for record in caplog.records if record.name == "metakv.audit"]
    assert len(audited) == 3 and "401 GRPC /etcdserverpb.Auth/Authenticate" in audited[0]
    assert "authentication failed for the user 'writer'" in audited[0]


async def test_calls_need_a_valid_token(port: Port) -> None:
    missing = await refused(port.kv().Range(rpc_pb2.RangeRequest(key=b"app/a"), timeout=WAIT_S))
    assert (missing.code(), missing.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: user name is empty")
    bad = await refused(port.kv().Range(rpc_pb2.RangeRequest(key=b"app/a"), metadata=(("token", "guess"),),
                                        timeout=WAIT_S))
    assert (bad.code(), bad.details()) == (grpc.StatusCode.UNAUTHENTICATED, "etcdserver: invalid auth token")
    status = await rpc_pb2_grpc.MaintenanceStub(port.channel).Status(rpc_pb2.StatusRequest(),
                                                                      metadata=as_user("reader"), timeout=WAIT_S)
    assert status.leader == 1  # any valid token reads the cluster's status


async def test_the_token_rules_apply_per_key_and_prefix(port: Port, caplog: pytest.LogCaptureFixture) -> None:
    kv = port.kv()
    await kv.Put(rpc_pb2.PutRequest(key=b"app/a", value=b"1"), metadata=as_user("ops"), timeout=WAIT_S)
    got = await kv.Range(rpc_pb2.RangeRequest(key=b"app/a"), metadata=as_user("reader"), timeout=WAIT_S)
    assert got.kvs[0].value == b"1"
    caplog.set_level(logging.WARNING, logger="metakv.audit")
    denied = [  # made one by one: a grpc.aio call starts as soon as it is made
        lambda: kv.Put(rpc_pb2.PutRequest(key=b"app/a", value=b"2"), metadata=as_user("reader"), timeout=WAIT_S),
        lambda: kv.Range(rpc_pb2.RangeRequest(key=b"app/", range_end=prefix_end(b"app/")), metadata=as_user("reader"),
                         timeout=WAIT_S),  # app/private/ is denied, so the prefix as a whole is
        lambda: kv.Range(rpc_pb2.RangeRequest(key=b"other"), metadata=as_user("writer"), timeout=WAIT_S),
        lambda: kv.Txn(rpc_pb2.TxnRequest(success=[rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=b"x",
                                                                                                 value=b"v"))]),
                       metadata=as_user("writer"), timeout=WAIT_S),
        lambda: kv.Compact(rpc_pb2.CompactionRequest(revision=1), metadata=as_user("writer"), timeout=WAIT_S),
        lambda: rpc_pb2_grpc.LeaseStub(port.channel).LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=30),
                                                               metadata=as_user("reader"), timeout=WAIT_S),
    ]
    for call in denied:
        error = await refused(call())
        assert (error.code(), error.details()) == (grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied")
    assert (await kv.Range(rpc_pb2.RangeRequest(key=b"app/a"), metadata=as_user("reader"), timeout=WAIT_S)).count == 1
    lines = [record.getMessage() for record in caplog.records if record.name == "metakv.audit"]
    assert len(lines) == len(denied)
    assert lines[0].startswith("audit: 403 GRPC /etcdserverpb.KV/Put from 127.0.0.1:")
    assert "token 'reader': denied: token 'reader' lacks write access to the key 'app/a'" in lines[0]


async def test_a_watch_on_keys_the_token_cannot_read_is_canceled(port: Port) -> None:
    requests = [rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=b"app/private/x", watch_id=1)),
                rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=b"app/a", watch_id=2))]
    stream = rpc_pb2_grpc.WatchStub(port.channel).Watch(iter(requests), metadata=as_user("reader"), timeout=WAIT_S)
    first, second = await stream.read(), await stream.read()
    stream.cancel()
    assert (first.watch_id, first.created, first.canceled, first.cancel_reason) == (
        1, True, True, "etcdserver: permission denied")
    assert (second.watch_id, second.created, second.canceled) == (2, True, False)


async def test_the_gateway_takes_the_token_in_the_authorization_header(port: Port) -> None:
    key = base64.b64encode(b"app/g").decode()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port.api.port}", timeout=WAIT_S) as http:
        token = (await http.post("/v3/auth/authenticate", json={"name": "writer", "password": "writer-secret"})).json()
        assert token["token"] == "writer-secret"
        put = await http.post("/v3/kv/put", json={"key": key, "value": "MQ=="}, headers={"Authorization": token["token"]})
        assert put.status_code == 200, put.text
        denied = await http.post("/v3/kv/put", json={"key": key, "value": "Mg=="},
                                 headers={"Authorization": "reader-secret"})
        missing = await http.post("/v3/kv/range", json={"key": key})
    assert (denied.status_code, denied.json()["code"], denied.json()["message"]) == (
        403, 7, "etcdserver: permission denied")
    assert (missing.status_code, missing.json()["message"]) == (400, "etcdserver: user name is empty")
