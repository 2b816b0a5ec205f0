"""A follower's link to the leader: building its forwarding client must not stall the node.

Building a metakv client loads a TLS trust store per connection pool (seconds of CPU on a
loaded machine). Built on the event loop, it stalled a fresh follower or observer past
its fetch timeout at its first forwarded call, so it dropped its leader and answered
etcd's "no leader" to the calls queued meanwhile (seen right after `cluster up`)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from app.etcd import leader_link
from app.etcd.errors import EtcdError
from app.etcd.leader_link import LeaderLink
from app.service import NotLeaderError, Op, OpKind
from metakv.errors import PROBLEM_TYPE_PREFIX, InvalidRequest, MetakvError, ServerError
from tests.http.conftest import anyio_backend  # noqa: F401  (asyncio)

pytestmark = pytest.mark.anyio
LEADER_URL = "http://127.0.0.1:1"
LEADER_VERSION = 7
BUILD_WAIT_S = 3.0  # how long a build waits for the test to let it finish (a bound, not a figure)


class Follower:
    """A follower's service: linearizable reads go to the leader, local ones are answered."""

    def __init__(self) -> None:
        self.local_reads: list[int | None] = []

    async def wait_readable(self, consistency: str, min_version: int | None, wait_ms: int) -> None:
        if consistency != "local":
            raise NotLeaderError(LEADER_URL, 1)
        self.local_reads.append(min_version)

    async def txn(self, *branches: object) -> None:
        raise NotLeaderError(LEADER_URL, 1)


async def test_the_node_serves_while_its_forwarding_client_is_built_once(monkeypatch: pytest.MonkeyPatch) -> None:
    build_started, build_may_end = threading.Event(), threading.Event()
    builds: list[bool] = []  # per build: whether the test let it end (False: it timed out)

    class SlowClient:
        def __init__(self, url: str, **options: Any) -> None:
            build_started.set()
            builds.append(build_may_end.wait(BUILD_WAIT_S))

        async def list(self, *args: Any, **options: Any) -> SimpleNamespace:
            return SimpleNamespace(version=LEADER_VERSION)

        async def aclose(self) -> None:
            pass

    monkeypatch.setattr(leader_link, "AsyncClient", SlowClient)
    follower = Follower()
    link = LeaderLink(follower)  # type: ignore[arg-type]
    reads = [asyncio.create_task(link.barrier(serializable=False)) for _ in range(3)]
    for _ in range(int(BUILD_WAIT_S / 0.01)):
        if build_started.is_set():
            break
        await asyncio.sleep(0.01)
    await link.barrier(serializable=True)  # served while the client is being built
    build_may_end.set()
    await asyncio.gather(*reads)
    await link.close()
    assert builds == [True]  # one build for the three reads, ended by the test, not by its timeout
    # the local read was answered first, then each linearizable one at the leader's version
    assert follower.local_reads == [None, LEADER_VERSION, LEADER_VERSION, LEADER_VERSION]


async def test_a_txn_too_large_to_forward_is_refused_with_etcds_invalid_argument() -> None:
    """The leader's HTTP API takes at most 128 ops per branch; before, the refusal came back
    as etcd's "no leader", which clients retry for ever."""
    link = LeaderLink(Follower())  # type: ignore[arg-type]
    puts = tuple(Op(OpKind.PUT, f"k{n}", b"v") for n in range(129))
    with pytest.raises(EtcdError) as refused:
        await link.txn((), puts)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.message.startswith("metakv: a follower forwards a txn of at most 128 metakv ops")
    await link.close()


@pytest.mark.parametrize(("refusal", "answer"), [
    (InvalidRequest("Value too large", status=413), (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: request is too large")),
    (InvalidRequest("Unprocessable", "success.0.put.key: bad", status=422),
     (grpc.StatusCode.INVALID_ARGUMENT, "metakv: the leader refused the forwarded call: Unprocessable: "
                                        "success.0.put.key: bad")),
    (ServerError("Storage quota exceeded", status=507, problem={"type": PROBLEM_TYPE_PREFIX + "quota-exceeded"}),
     (grpc.StatusCode.RESOURCE_EXHAUSTED, "etcdserver: mvcc: database space exceeded")),
])
async def test_a_leaders_refusal_of_a_forwarded_txn_is_not_answered_no_leader(
        monkeypatch: pytest.MonkeyPatch, refusal: MetakvError, answer: tuple[grpc.StatusCode, str]) -> None:
    """Before, every refusal came back as etcd's "no leader" (UNAVAILABLE), which clients
    retry for ever, and a follower failed what the leader itself answered at once."""
    class RefusingClient:
        def __init__(self, url: str, **options: Any) -> None:
            pass

        def txn(self) -> Any:
            async def commit() -> None:
                raise refusal
            ignore = {name: lambda *args, **options: None for name in (
                "then_put", "then_delete", "then_get", "else_put", "else_delete", "else_get")}
            return SimpleNamespace(**ignore, commit=commit)

        async def aclose(self) -> None:
            pass

    monkeypatch.setattr(leader_link, "AsyncClient", RefusingClient)
    link = LeaderLink(Follower())  # type: ignore[arg-type]
    with pytest.raises(EtcdError) as refused:
        await link.txn((), (Op(OpKind.PUT, "k", b"v"),))
    await link.close()
    assert (refused.value.code, refused.value.message) == answer
