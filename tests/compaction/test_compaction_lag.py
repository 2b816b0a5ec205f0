"""min_compaction_lag_ms: records younger than the lag stay uncleaned, so their history
(at_version reads, watch since) stays readable at least that long (docs/compaction.md)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from app.config import HostPort, NodeConfig
from app.runtime import NodeRuntime
from raft.types import Batch
from storage.commands import Command, Op, OpKind, encode_command
from storage.segment_log import SegmentLog
from storage.state_machine import StateMachine
from tests.cluster import free_ports

LAG_MS = 60_000


def _node_with_old_and_young_records(tmp_path: Path) -> Path:
    """Offsets 0..9, puts over three keys, all applied and durable: 0..5 appended two lag
    periods ago, 6..9 just now."""
    node_dir = tmp_path / "node"
    (node_dir / "log").mkdir(parents=True)
    now_ms = int(time.time() * 1000)
    batches = [Batch(offset, 1, now_ms - 2 * LAG_MS if offset < 6 else now_ms, False,
                     (encode_command(Command((), (Op(OpKind.PUT, f"k{offset % 3}", b"%d" % offset),))),))
               for offset in range(10)]
    log = SegmentLog(node_dir / "log")
    for batch in batches:
        log.append(batch)
    log.flush()
    log.close()
    with StateMachine(str(node_dir / "state.db")) as state:
        state.apply(batches)
        state.sync()
    return node_dir


def _clean(node_dir: Path, lag_ms: int, force: bool) -> tuple[dict[str, Any], int]:
    http_port, raft_port, leader_raft_port = free_ports(3)
    config = NodeConfig(
        node_id=1, data_dir=node_dir, listen_http=HostPort("127.0.0.1", http_port),
        listen_raft=HostPort("127.0.0.1", raft_port), voters={2: HostPort("127.0.0.1", leader_raft_port)},
        advertise_http=f"http://127.0.0.1:{http_port}", observer=True, cleaner_interval_ms=0,
        cleaner_min_dirty_ratio=0.0, min_compaction_lag_ms=lag_ms)

    async def scenario() -> tuple[dict[str, Any], int]:
        runtime = NodeRuntime(config, seed=1)
        await runtime.start()
        try:
            # What the leader would announce: everything is replicated everywhere.
            runtime.clean_target = lambda: (10, 10)  # type: ignore[method-assign]
            report = await runtime._clean(force)
            return report, runtime.state.oldest_version
        finally:
            await runtime.stop()

    return asyncio.run(scenario())


def test_the_cleaner_leaves_records_younger_than_the_lag(tmp_path: Path) -> None:
    report, oldest_version = _clean(_node_with_old_and_young_records(tmp_path), LAG_MS, force=False)
    assert report["cleaned"] and report["cleaned_end"] == 6, report
    assert oldest_version == 6  # history from version 6 on is still readable


def test_nothing_is_cleaned_while_every_uncleaned_record_is_young(tmp_path: Path) -> None:
    node_dir = _node_with_old_and_young_records(tmp_path)
    first, _ = _clean(node_dir, LAG_MS, force=False)
    assert first["cleaned_end"] == 6, first
    again, oldest_version = _clean(node_dir, LAG_MS, force=False)
    assert not again["cleaned"] and "younger than min_compaction_lag_ms" in again["reason"], again
    assert oldest_version == 6


def test_an_admin_compaction_and_a_zero_lag_clean_young_records_too(tmp_path: Path) -> None:
    forced, _ = _clean(_node_with_old_and_young_records(tmp_path / "forced"), LAG_MS, force=True)
    assert forced["cleaned"] and forced["cleaned_end"] == 10, forced
    no_lag, oldest_version = _clean(_node_with_old_and_young_records(tmp_path / "no-lag"), 0, force=False)
    assert no_lag["cleaned"] and no_lag["cleaned_end"] == 10, no_lag
    assert oldest_version == 10
