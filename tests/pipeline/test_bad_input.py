"""Bad input: one line on stderr, exit code 2, nothing at --output. Corruption names the file
and byte position; --skip-corrupt skips it and says how much it skipped."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgpack

from raft.types import Batch
from storage.batch_codec import encode_batch, iter_batches
from tests.pipeline.conftest import Cluster
from tests.pipeline.helpers import run_cli


def _expect_bad(capsys, tmp_path: Path, *argv: str) -> str:  # type: ignore[no-untyped-def]
    output = tmp_path / "out"
    code, _, err = run_cli(capsys, *argv, "--output", str(output))
    assert code == 2
    assert not output.exists()
    assert not list(tmp_path.glob(".out.partial-*"))
    lines = [line for line in err.splitlines() if line.startswith("pipeline: error:")]
    assert len(lines) == 1, err
    return lines[0]


def _one_node_copy(cluster: Cluster, tmp_path: Path) -> Path:
    node = tmp_path / "node1"
    shutil.copytree(cluster.node("1"), node)
    return node


def test_empty_and_foreign_directories(spark, tmp_path: Path, capsys) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "empty directory" in _expect_bad(capsys, tmp_path, "materialize", "--input", str(empty))
    foreign = tmp_path / "foreign"
    (foreign / "docs").mkdir(parents=True)
    (foreign / "notes.txt").write_text("hello")
    assert "not a metakv data dir" in _expect_bad(capsys, tmp_path, "audit", "--input", str(foreign))
    assert "not a load-test result folder" in _expect_bad(capsys, tmp_path, "loadtest", "--input", str(foreign))


def test_truncated_segment(spark, cluster: Cluster, tmp_path: Path, capsys) -> None:
    node = _one_node_copy(cluster, tmp_path)
    segment = sorted((node / "log").glob("*.log"))[1]
    data = segment.read_bytes()
    segment.write_bytes(data[: len(data) - 7])
    line = _expect_bad(capsys, tmp_path, "materialize", "--input", str(node))
    assert f"{segment.name}: truncated batch at byte " in line


def test_unknown_record_version(spark, cluster: Cluster, tmp_path: Path, capsys) -> None:
    node = _one_node_copy(cluster, tmp_path)
    segment = sorted((node / "log").glob("*.log"))[-1]
    batches = [b for _, b in iter_batches(segment.read_bytes())]
    target = next(b for b in batches if not b.control)
    future = msgpack.packb([9, [], [], []])
    rewritten = b"".join(
        encode_batch(Batch(b.base_offset, b.epoch, b.timestamp_ms, False, (future, *b.records[1:])))
        if b is target else encode_batch(b) for b in batches)
    segment.write_bytes(rewritten)
    line = _expect_bad(capsys, tmp_path, "churn", "--input", str(node))
    assert f"record at offset {target.base_offset}" in line and "unknown command version 9" in line


def test_corrupt_batch_fails_or_is_skipped_and_counted(spark, cluster: Cluster, tmp_path: Path, capsys) -> None:
    node = _one_node_copy(cluster, tmp_path)
    segment = sorted((node / "log").glob("*.log"))[2]
    data = bytearray(segment.read_bytes())
    positions = [p for p, _ in iter_batches(bytes(data))]
    victim = positions[len(positions) // 2]
    data[victim + 40] ^= 0xFF
    segment.write_bytes(bytes(data))
    line = _expect_bad(capsys, tmp_path, "audit", "--input", str(node), str(cluster.node("2")))
    assert f"{segment.name}: corrupt batch at byte {victim}: CRC32C mismatch" in line

    output = tmp_path / "skipped"
    code, out, _ = run_cli(capsys, "materialize", "--input", str(node), "--output", str(output),
                           "--skip-corrupt", "--version", "10")
    assert code == 0
    summary = json.loads((output / "summary.json").read_text())
    assert summary["skipped_regions"] == 1
    assert summary["skipped_bytes"] == positions[positions.index(victim) + 1] - victim
    assert "skipped 1 corrupt region(s)" in out


def test_bad_flags_exit_2(tmp_path: Path, capsys) -> None:
    code, _, err = run_cli_flags(capsys, "materialize", "--input", str(tmp_path), "--output", str(tmp_path / "o"),
                                 "--version", "-3")
    assert code == 2 and len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def run_cli_flags(capsys, *argv: str) -> tuple[int, str, str]:  # type: ignore[no-untyped-def]
    try:
        return run_cli(capsys, *argv)
    except SystemExit as exit_:
        captured = capsys.readouterr()
        return int(exit_.code or 0), captured.out, captured.err
