"""audit: identical committed prefixes pass; a changed record or a dropped batch in one
replica is found at the right (node, offset, epoch) with exit code 1."""

from __future__ import annotations

import json
from pathlib import Path

from raft.types import Batch
from storage.batch_codec import encode_batch, iter_batches
from storage.commands import decode_command, encode_command, put
from tests.pipeline.conftest import Cluster
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
