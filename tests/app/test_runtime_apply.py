"""A node applies committed batches from the log's in-memory tail (storage/tail_cache.py):
a tail a new leader truncated must never be applied from there.

The node is an observer driven by real raft messages from two leaders that never run (their
answers are injected): the epoch-1 leader sends three records of which one commits, the
epoch-2 leader cuts the other two and sends its own in their place.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

from app.config import HostPort, NodeConfig
from app.runtime import NodeRuntime
from raft.messages import NO_EPOCH, Envelope, FetchResponse
from raft.types import Batch, ErrorCode
from storage.commands import encode_command, put
from tests.cluster import free_ports

WAIT_S = 10.0


def _fetch_answer(leader_id: int, epoch: int, fetch_offset: int, high_watermark: int,
                  records: tuple[Batch, ...] = (), diverging: tuple[int, int] = (NO_EPOCH, -1)) -> FetchResponse:
    return FetchResponse(ErrorCode.NONE, epoch, leader_id, f"http://leader-{leader_id}", fetch_offset,
                         high_watermark, 0, 0, 0, records, diverging[0], diverging[1], None)


async def _answer_until(runtime: NodeRuntime, leader_id: int, answer: Callable[[int], FetchResponse],
                        done: Callable[[], bool], what: str) -> None:
    """Answer the node's fetch (at its log end) until ``done``: the first answers of a new
    leader only make the node follow it, then it fetches again."""
    deadline = time.monotonic() + WAIT_S
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        response = dataclasses.replace(answer(runtime.log.end_offset()), fetch_epoch=runtime.log.last_epoch())
        runtime._on_message(Envelope(leader_id, runtime.node_id, response))
        await asyncio.sleep(0.02)


def _value(runtime: NodeRuntime, version: int | None = None) -> bytes:
    entry = runtime.state.get("k", at_version=version)[1]
    assert entry is not None
    return entry.value


async def _scenario(tmp_path: Path) -> None:
    http_port, raft_port, raft_port_2, raft_port_3 = free_ports(4)
    config = NodeConfig(
        node_id=1, data_dir=tmp_path / "observer", listen_http=HostPort("127.0.0.1", http_port),
        listen_raft=HostPort("127.0.0.1", raft_port),
        voters={2: HostPort("127.0.0.1", raft_port_2), 3: HostPort("127.0.0.1", raft_port_3)},
        advertise_http=f"http://127.0.0.1:{http_port}", observer=True,
    )
    fatal: list[BaseException] = []
    runtime = NodeRuntime(config, seed=1, on_fatal=fatal.append)
    await runtime.start()
    try:
        old = Batch(0, 1, 0, False, tuple(encode_command(put("k", b"old-%d" % index)) for index in range(3)))
        await _answer_until(runtime, 2, lambda offset: _fetch_answer(2, 1, offset, 1, (old,)),
                            lambda: runtime.applied_version == 1, "offset 0 applied")
        assert _value(runtime) == b"old-0"
        assert runtime.log.end_offset() == 3
        assert runtime.log.cached_bytes() > 0, "the uncommitted records 1 and 2 are held in memory"

        await _answer_until(runtime, 3, lambda offset: _fetch_answer(3, 2, offset, 1, diverging=(1, 1)),
                            lambda: runtime.log.end_offset() == 1, "the epoch-1 tail truncated")
        new = Batch(1, 2, 0, False, tuple(encode_command(put("k", b"new-%d" % index)) for index in (1, 2)))
        await _answer_until(runtime, 3, lambda offset: _fetch_answer(3, 2, offset, 3, (new,)),
                            lambda: runtime.applied_version == 3, "the epoch-2 records applied")

        assert [_value(runtime, version) for version in (1, 2, 3)] == [b"old-0", b"new-1", b"new-2"]
        assert runtime.log.cached_bytes() == 0, "applied batches are let go"
        assert not fatal, fatal
    finally:
        await runtime.stop()


def test_a_truncated_tail_is_never_applied_from_memory(tmp_path: Path) -> None:
    asyncio.run(_scenario(tmp_path))
