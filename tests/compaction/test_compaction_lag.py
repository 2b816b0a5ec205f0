"""min_compaction_lag_ms: records applied on this replica less than the lag ago stay
uncleaned, so their history (at_version reads, watch since) stays readable at least that
long (docs/compaction.md). The age is measured on each replica's own clock from when it
applied a version: batch timestamps come from the leader's monotonic clock."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from app.config import HostPort, NodeConfig
from app.runtime import NodeRuntime
from raft.node import Role
from storage.commands import put
from tests.app.test_cleaned_state_recovery import _log_and_state_at_10
from tests.cluster import free_ports

LAG_MS = 60_000


def _config(data_dir: Path, lag_ms: int, lone_voter: bool = False) -> NodeConfig:
    http_port, raft_port, leader_raft_port = free_ports(3)
    voters = ({1: HostPort("127.0.0.1", raft_port)} if lone_voter else {2: HostPort("127.0.0.1", leader_raft_port)})
    return NodeConfig(
        node_id=1, data_dir=data_dir, listen_http=HostPort("127.0.0.1", http_port),
        listen_raft=HostPort("127.0.0.1", raft_port), voters=voters, observer=not lone_voter,
        advertise_http=f"http://127.0.0.1:{http_port}", cleaner_interval_ms=0,
        cleaner_min_dirty_ratio=0.0, min_compaction_lag_ms=lag_ms)


def _clean(node_dir: Path, lag_ms: int, force: bool, arrivals: list[tuple[int, float]] | None = None
           ) -> tuple[dict[str, Any], int]:
    """Start the node, optionally replace what it knows of when versions arrived (version
    end, seconds ago), clean as the periodic cleaner (or an admin compaction) would."""
    async def scenario() -> tuple[dict[str, Any], int]:
        runtime = NodeRuntime(_config(node_dir, lag_ms), seed=1)
        await runtime.start()
        try:
            if arrivals is not None:
                marks = runtime.maintenance.arrival_marks.marks
                marks.clear()
                marks.extend((end, time.monotonic() - ago_s) for end, ago_s in arrivals)
            runtime.maintenance.clean_target = lambda: (10, 10)  # type: ignore[method-assign]  # all replicated
            report = await runtime.maintenance.clean(force)
            return report, runtime.state.oldest_version
        finally:
            await runtime.stop()

    return asyncio.run(scenario())


def test_the_cleaner_stops_at_the_versions_applied_less_than_the_lag_ago(tmp_path: Path) -> None:
    # versions below 6 arrived two lags ago, the rest just now
    report, oldest_version = _clean(_log_and_state_at_10(tmp_path), LAG_MS, force=False,
                                    arrivals=[(6, 2 * LAG_MS / 1000), (10, 0.0)])
    assert report["cleaned"] and report["cleaned_end"] == 6, report
    assert oldest_version == 6  # history from version 6 on is still readable


def test_after_a_restart_what_the_log_holds_counts_as_just_arrived(tmp_path: Path) -> None:
    report, oldest_version = _clean(_log_and_state_at_10(tmp_path), LAG_MS, force=False)
    assert not report["cleaned"] and "younger than min_compaction_lag_ms" in report["reason"], report
    assert oldest_version == 0


def test_an_admin_compaction_and_a_zero_lag_clean_young_records_too(tmp_path: Path) -> None:
    forced, _ = _clean(_log_and_state_at_10(tmp_path / "forced"), LAG_MS, force=True)
    assert forced["cleaned"] and forced["cleaned_end"] == 10, forced
    no_lag, oldest_version = _clean(_log_and_state_at_10(tmp_path / "no-lag"), 0, force=False)
    assert no_lag["cleaned"] and no_lag["cleaned_end"] == 10, no_lag
    assert oldest_version == 10


def test_a_leader_keeps_its_just_written_records_until_the_lag_passes(tmp_path: Path) -> None:
    """End to end on a real lone voter: writes, then the periodic cleaning, before and after
    the lag (a short one here) has passed."""
    lag_ms = 1500

    async def scenario() -> tuple[dict[str, Any], dict[str, Any], int]:
        runtime = NodeRuntime(_config(tmp_path / "n1", lag_ms, lone_voter=True), seed=1)
        await runtime.start()
        try:
            for _ in range(200):  # bounded: a lone voter elects itself within a few seconds
                if runtime.node.role == Role.LEADER:
                    break
                await asyncio.sleep(0.05)
            assert runtime.node.role == Role.LEADER
            for index in range(20):
                await runtime.propose(put(f"k{index % 3}", b"%d" % index))
            written_s = time.monotonic()
            runtime.maintenance.clean_target = lambda: (runtime.applied_version,) * 2  # type: ignore[method-assign]
            early = await runtime.maintenance.clean(force=False)
            await asyncio.sleep(max(0.0, written_s + lag_ms / 1000 + 0.1 - time.monotonic()))
            late = await runtime.maintenance.clean(force=False)
            return early, late, runtime.applied_version
        finally:
            await runtime.stop()

    early, late, applied = asyncio.run(scenario())
    assert not early["cleaned"], f"records just written were cleaned despite the lag: {early}"
    assert late["cleaned"] and late["cleaned_end"] == applied, late
