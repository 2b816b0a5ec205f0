"""One SparkSession for every pipeline test, and data dirs written by the real storage code.

The cluster fixture is three node data directories made the way a node makes them: the
real SegmentLog appends and flushes the batches, the real StateMachine applies the committed
ones, snapshots come from StateMachine.create_snapshot. Node 2 drops its log prefix behind a
snapshot (so replay must start from the snapshot); node 3 lags behind.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from pipeline.session import SparkSettings, build_session
from pipeline.synthetic import workload
from raft.types import Batch
from storage.segment_log import SegmentLog
from storage.state_machine import StateMachine

RECORDS = 600
SEGMENT_BYTES = 4096


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    session = build_session(SparkSettings(master="local[2]", shuffle_partitions=2))
    try:
        yield session
    finally:
        session.stop()


@dataclass(frozen=True)
class Cluster:
    root: Path
    batches: list[Batch]
    committed_version: int
    snapshot_version: int

    def node(self, name: str) -> Path:
        return self.root / name

    def copy(self, target: Path) -> Path:
        shutil.copytree(self.root, target)
        return target


def _version_after(batches: list[Batch]) -> int:
    return batches[-1].next_offset if batches else 0


def make_node(data_dir: Path, log_batches: list[Batch], committed: list[Batch], snapshot_after: int | None,
              drop_prefix: bool) -> None:
    log = SegmentLog(data_dir / "log", segment_bytes=SEGMENT_BYTES)
    try:
        for batch in log_batches:
            log.append(batch)
        log.flush()
        with StateMachine(str(data_dir / "state.db")) as machine:
            if snapshot_after is not None:
                machine.apply(committed[:snapshot_after])
                snapshot_id = machine.create_snapshot(str(data_dir / "snapshots"))
                if drop_prefix:
                    log.record_snapshot(snapshot_id)
                    log.delete_before(snapshot_id.end_offset)
                machine.apply(committed[snapshot_after:])
            else:
                machine.apply(committed)
    finally:
        log.close()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    root = tmp_path_factory.mktemp("cluster")
    batches = list(workload(seed=11, records=RECORDS))
    committed = batches[:-6]  # the last batches are replicated but not committed
    snapshot_after = len(committed) * 2 // 5
    make_node(root / "1", batches, committed, snapshot_after, drop_prefix=False)
    make_node(root / "2", batches, committed, snapshot_after, drop_prefix=True)
    lagging = batches[: len(batches) * 4 // 5]
    make_node(root / "3", lagging, lagging, None, drop_prefix=False)
    return Cluster(root, batches, _version_after(committed), _version_after(committed[:snapshot_after]))
