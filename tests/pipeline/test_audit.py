"""audit: identical committed prefixes pass; a changed record or a dropped batch in one
replica is found at the right (node, offset, epoch) with exit code 1; replicas cleaned to
different dirty offsets are no divergence, and a change planted in them still is."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from raft.types import Batch
from storage.batch_codec import encode_batch, iter_batches
from storage.cleaner import clean_prefix
from storage.commands import decode_command, encode_command, put
from storage.segment_log import SegmentLog
from tests.pipeline.conftest import SEGMENT_BYTES, Cluster
from tests.pipeline.helpers import run_cli


def _rewrite_segment(segment: Path, change) -> None:  # type: ignore[no-untyped-def]
    """Re-encode every batch of ``segment`` through ``change`` (None drops the batch)."""
    data = segment.read_bytes()
    out = bytearray()
    for _, batch in iter_batches(data):
        changed = change(batch)
        if changed is not None:
            out += encode_batch(changed)
    segment.write_bytes(bytes(out))


def _data_batch_in_middle(node: Path) -> tuple[Path, Batch]:
    segments = sorted((node / "log").glob("*.log"))
    segment = segments[len(segments) // 2]
    batches = [b for _, b in iter_batches(segment.read_bytes()) if not b.control]
    return segment, batches[len(batches) // 2]


def test_healthy_replicas_pass(spark, cluster: Cluster, tmp_path: Path, capsys) -> None:
    output = tmp_path / "out"
    code, out, _ = run_cli(capsys, "audit", "--input", str(cluster.root), "--output", str(output))
    assert code == 0, out
    summary = json.loads((output / "summary.json").read_text())
    assert summary["divergent_records"] == 0
    assert summary["committed_version"] == cluster.committed_version
    assert "OK" in out


def test_changed_record_and_dropped_batch_are_found(spark, cluster: Cluster, tmp_path: Path, capsys) -> None:
    changed_copy = cluster.copy(tmp_path / "changed")
    segment, target = _data_batch_in_middle(changed_copy / "3")
    command = decode_command(target.records[0])
    key = command.success[0].key if command.success else "planted"
    forged = encode_command(put(key, b"not what the leader wrote"))

    def change(batch: Batch) -> Batch:
        if batch.base_offset != target.base_offset:
            return batch
        return Batch(batch.base_offset, batch.epoch, batch.timestamp_ms, False, (forged, *batch.records[1:]))

    _rewrite_segment(segment, change)
    output = tmp_path / "out-changed"
    code, out, _ = run_cli(capsys, "audit", "--input", str(changed_copy), "--output", str(output))
    assert code == 1
    first = json.loads((output / "summary.json").read_text())["first_divergence"]
    assert (first["node"], first["offset"], first["epoch"]) == ("3", target.base_offset, target.epoch)
    assert f"node 3 offset {target.base_offset} epoch {target.epoch}" in out

    dropped_copy = cluster.copy(tmp_path / "dropped")
    segment, target = _data_batch_in_middle(dropped_copy / "2")
    _rewrite_segment(segment, lambda b: None if b.base_offset == target.base_offset else b)
    output = tmp_path / "out-dropped"
    code, out, _ = run_cli(capsys, "audit", "--input", str(dropped_copy), "--output", str(output))
    assert code == 1
    first = json.loads((output / "summary.json").read_text())["first_divergence"]
    assert (first["node"], first["offset"], first["epoch"]) == ("2", target.base_offset, target.epoch)
    assert first["reason"] == "record missing"


def _cleaned_node(data_dir: Path, batches: list[Batch], dirty_offset: int) -> None:
    """A node whose log the real cleaner compacted below ``dirty_offset`` (as app/runtime.py does)."""
    log = SegmentLog(data_dir / "log", segment_bytes=SEGMENT_BYTES)
    try:
        for batch in batches:
            log.append(batch)
        log.flush()
        if dirty_offset:
            prefix = [b for b in log.iter_batches(0) if b.next_offset <= dirty_offset]
            result = clean_prefix(prefix, dirty_offset, prefix[-1].next_offset)
            log.replace_prefix(result.batches, result.clean_end)
            assert log.cleaned_end() == result.clean_end
    finally:
        log.close()


def _batch_holding(node: Path, wanted) -> tuple[Path, Batch]:  # type: ignore[no-untyped-def]
    for segment in sorted((node / "log").glob("*.log")):
        for _, batch in iter_batches(segment.read_bytes()):
            if not batch.control and wanted(batch):
                return segment, batch
    raise AssertionError("no such batch")


def test_replicas_cleaned_to_different_offsets(spark, cluster: Cluster, tmp_path: Path, capsys) -> None:
    batches = cluster.batches
    committed = cluster.committed_version
    root = tmp_path / "cleaned"
    for node, dirty in (("1", 200), ("2", 400), ("3", 200), ("4", 0)):
        _cleaned_node(root / node, batches, dirty)
    output = tmp_path / "out-healthy"
    code, out, _ = run_cli(capsys, "audit", "--input", str(root), "--output", str(output), "--version", str(committed))
    assert code == 0, out
    summary = json.loads((output / "summary.json").read_text())
    assert summary["divergent_records"] == 0
    ends = {row["node"]: row["cleaned_end"] for row in summary["nodes"]}
    assert ends["1"] == ends["3"] > 100 and ends["2"] > ends["1"] and ends["4"] == 0
    assert summary["cleaned_groups"] == {str(ends["1"]): ["1", "3"], str(ends["2"]): ["2"]}

    # Planted: a record changed where three nodes hold the log as written (node 1), and one
    # changed inside the prefix nodes 1 and 3 both cleaned to the same offset (node 3).
    raw_segment, raw_target = _batch_holding(root / "1", lambda b: ends["2"] < b.base_offset < committed - 20)
    cleaned_segment, cleaned_target = _batch_holding(root / "3", lambda b: 50 < b.base_offset < ends["1"] - 20)
    forged = encode_command(put("planted", b"not what the leader wrote"))
    for segment, target in ((raw_segment, raw_target), (cleaned_segment, cleaned_target)):
        _rewrite_segment(segment, lambda b, t=target: b if b.base_offset != t.base_offset else
                         Batch(b.base_offset, b.epoch, b.timestamp_ms, False, (forged, *b.records[1:])))
    output = tmp_path / "out-planted"
    code, out, _ = run_cli(capsys, "audit", "--input", str(root), "--output", str(output), "--version", str(committed))
    assert code == 1
    found = pd.read_parquet(output / "divergences.parquet")
    assert sorted(zip(found.node, found.offset, found.epoch, strict=True)) == sorted([
        ("3", cleaned_target.base_offset, cleaned_target.epoch), ("1", raw_target.base_offset, raw_target.epoch)])
    first = json.loads((output / "summary.json").read_text())["first_divergence"]
    assert (first["node"], first["offset"], first["epoch"]) == ("3", cleaned_target.base_offset, cleaned_target.epoch)
    assert f"node 3 offset {cleaned_target.base_offset} epoch {cleaned_target.epoch}" in out
    assert "node 2: prefix cleaned below offset" in out
