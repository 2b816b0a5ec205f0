"""materialize equals, row for row, what the real StateMachine holds at the same version."""

from __future__ import annotations

from pathlib import Path

from storage.state_machine import StateMachine
from tests.pipeline.conftest import Cluster
from tests.pipeline.helpers import frame_entries, parquet_rows, run_cli, sqlite_entries


def test_latest_committed_equals_state_db(spark, cluster: Cluster, tmp_path: Path, capsys) -> None:
    output = tmp_path / "out"
    code, out, _ = run_cli(capsys, "materialize", "--input", str(cluster.node("1")), "--output", str(output))
    assert code == 0
    expected = sqlite_entries(cluster.node("1") / "state.db")
    assert len(expected) > 20
    assert frame_entries(parquet_rows(output / "entries.parquet")) == expected
    assert f"version {cluster.committed_version}" in out


def test_replay_from_snapshot_when_the_log_prefix_is_gone(spark, cluster: Cluster, tmp_path: Path, capsys) -> None:
    node = cluster.node("2")
    assert min(int(p.name[:20]) for p in (node / "log").glob("*.log")) > 0
    output = tmp_path / "out"
    code, _, _ = run_cli(capsys, "materialize", "--input", str(cluster.root), "--node", "2", "--output", str(output))
    assert code == 0
    assert frame_entries(parquet_rows(output / "entries.parquet")) == sqlite_entries(node / "state.db")


def test_older_version_equals_the_state_machine_read_at_that_version(spark, cluster: Cluster, tmp_path: Path,
                                                                    capsys) -> None:
    version = cluster.snapshot_version + 37
    output = tmp_path / "out"
    code, _, _ = run_cli(capsys, "materialize", "--input", str(cluster.node("1")), "--output", str(output),
                         "--version", str(version))
    assert code == 0
    with StateMachine(str(tmp_path / "copy.db")) as machine:
        from pipeline.synthetic import workload
        batches = [b for b in workload(seed=11, records=600) if b.next_offset <= version + 8]
        machine.apply(batches)
        _, items, _ = machine.list("", limit=10_000, at_version=version)
    expected = [(e.key, e.value, e.content_type, e.mod_version, e.create_version) for e in items]
    assert frame_entries(parquet_rows(output / "entries.parquet")) == expected


def test_cleaned_log_equals_the_state_of_the_original(spark, cluster: Cluster, tmp_path: Path, capsys) -> None:
    """The cleaner keeps each key's newest record as a put carrying its create_version:
    replaying the cleaned log must give exactly the rows of the node that applied it all."""
    from pipeline.synthetic import write_segments
    from storage.cleaner import clean_prefix

    committed = [b for b in cluster.batches if b.next_offset <= cluster.committed_version]
    dirty_offset = committed[len(committed) * 3 // 4].base_offset
    cleaned = clean_prefix(committed, dirty_offset, tombstone_horizon=dirty_offset)
    assert cleaned.records_out < cleaned.records_in
    rest = [b for b in cluster.batches if b.base_offset >= cleaned.clean_end]
    node = tmp_path / "cleaned"
    write_segments(str(node / "log"), cleaned.batches + rest, segment_bytes=4096)
    output = tmp_path / "out"
    code, _, _ = run_cli(capsys, "materialize", "--input", str(node), "--output", str(output),
                         "--version", str(cluster.committed_version))
    assert code == 0
    assert frame_entries(parquet_rows(output / "entries.parquet")) == sqlite_entries(cluster.node("1") / "state.db")
