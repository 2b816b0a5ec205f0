"""TLS on the etcd port (the node's HTTPS files), in process: the one port's front and the
two-port layout both serve gRPC and the gateway over TLS with a client certificate (which, with
a token file, stands for the token it names), and refuse plaintext and certificate-less
clients. (port_security_node.py runs etcdctl against a node.)"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest

from app.auth import AuthTokens, load_auth_policy
from app.etcd.mapping import EtcdMapping
from app.etcd.protos import rpc_pb2, rpc_pb2_grpc
from app.etcd.serve import EtcdApi
from app.tls import TlsFiles
from tests.http.service_double import InProcessService
from tests.security.certs_fixture import CertSet, make_test_certs

pytestmark = pytest.mark.anyio
WAIT_S = 10
REFUSED_WAIT_S = 2


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertSet:
    return make_test_certs(Path(tmp_path_factory.mktemp("etcd-tls-certs")), range(1, 2), ("root",))


def credentials(certs: CertSet, client: bool = True) -> grpc.ChannelCredentials:
    cert, key = certs.client("root")
    return grpc.ssl_channel_credentials(certs.ca.read_bytes(), key.read_bytes() if client else None,
                                        cert.read_bytes() if client else None)


def https(certs: CertSet, client: bool = True) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.ca))
    if client:
        context.load_cert_chain(*certs.client("root"))
    return context


@pytest.fixture(params=["one port", "two ports"])
async def api(request: pytest.FixtureRequest, service: InProcessService, certs: CertSet,
              tmp_path: Path) -> AsyncIterator[EtcdApi]:
    gateway = None if request.param == "one port" else ("127.0.0.1", 0)
    files = certs.node(1)
    tokens = tmp_path / "tokens.toml"  # the client certificate "root" names the token root: no token sent
    tokens.write_text(f'[[tokens]]\nname = "root"\nsha256 = "{hashlib.sha256(b"unused").hexdigest()}"\n'
                      'rules = { "tls/" = "write" }\n')
    api = EtcdApi(EtcdMapping(service, "test-cluster", {1: []}), "127.0.0.1", 0, gateway,
                  TlsFiles(files.cert_file, files.key_file, certs.ca), AuthTokens(load_auth_policy(tokens)))
    await api.start()
    try:
        yield api
    finally:
        await api.stop()


def gateway_url(api: EtcdApi) -> str:
    return f"https://127.0.0.1:{api.port if api.front is not None else api.gateway.port}/v3/kv/range"


async def test_grpc_and_the_gateway_over_tls_with_a_client_certificate(api: EtcdApi, certs: CertSet) -> None:
    async with grpc.aio.secure_channel(f"127.0.0.1:{api.port}", credentials(certs)) as channel:
        await rpc_pb2_grpc.KVStub(channel).Put(rpc_pb2.PutRequest(key=b"tls/a", value=b"1"), timeout=WAIT_S)
        with pytest.raises(grpc.aio.AioRpcError) as denied:  # the token's rules hold for its certificate
            await rpc_pb2_grpc.KVStub(channel).Put(rpc_pb2.PutRequest(key=b"other", value=b"1"), timeout=WAIT_S)
    assert denied.value.details() == "etcdserver: permission denied"
    async with httpx.AsyncClient(verify=https(certs), timeout=WAIT_S) as client:
        got = (await client.post(gateway_url(api), json={"key": base64.b64encode(b"tls/a").decode()})).json()
    assert base64.b64decode(got["kvs"][0]["value"]) == b"1"


async def test_plaintext_and_certificate_less_clients_are_refused(api: EtcdApi, certs: CertSet) -> None:
    for channel in (grpc.aio.insecure_channel(f"127.0.0.1:{api.port}"),
                    grpc.aio.secure_channel(f"127.0.0.1:{api.port}", credentials(certs, client=False))):
        async with channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await rpc_pb2_grpc.KVStub(channel).Range(rpc_pb2.RangeRequest(key=b"tls/a"), timeout=REFUSED_WAIT_S)
        assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    async with httpx.AsyncClient(verify=https(certs, client=False), timeout=WAIT_S) as client:
        with pytest.raises(httpx.TransportError):
            await client.post(gateway_url(api), json={"key": base64.b64encode(b"tls/a").decode()})


async def test_a_client_offering_h2_and_http_1_1_reaches_the_gateway(api: EtcdApi, certs: CertSet) -> None:
    """curl and browsers offer both by ALPN; gRPC clients offer h2 alone. The front chose h2
    for curl, so `curl https://...:2379/v3/kv/range` reached gRPC and failed."""
    context = https(certs)
    context.set_alpn_protocols(["h2", "http/1.1"])  # what curl offers (httpx would set its own)
    port = api.port if api.front is not None else api.gateway.port
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, ssl=context), WAIT_S)
    body = b'{"key": "dGxzL25vbmU="}'
    writer.write(b"POST /v3/kv/range HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    try:
        answer = await asyncio.wait_for(reader.read(), WAIT_S)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 200") and b'"header"' in answer, answer[:200]
