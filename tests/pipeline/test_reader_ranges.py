"""Byte-range splits: a log read as many small ranges (cutting batches anywhere, with the
segment's offset index or by scanning without it) gives exactly the rows of one range per
file, and a corrupt batch is reported (or skipped and counted) exactly once."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from pipeline.decode import decode_index, decode_range, decode_segment
from pipeline.errors import PipelineInputError
from pipeline.fs import HadoopFS
from pipeline.reader import discover, plan_ranges, read_entries
from pipeline.synthetic import workload
from storage.batch_codec import iter_batches
from storage.segment_log import SegmentLog

SEGMENT_BYTES = 48 * 1024
INDEX_INTERVAL_BYTES = 700
RECORDS = 1500


@pytest.fixture(scope="module")
def big_segments(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One node whose log has a few segments of many batches, with offset indexes."""
    node = tmp_path_factory.mktemp("ranges") / "7"
    log = SegmentLog(node / "log", segment_bytes=SEGMENT_BYTES, index_interval_bytes=INDEX_INTERVAL_BYTES)
    try:
        for batch in workload(seed=5, records=RECORDS):
            log.append(batch)
        log.flush()
    finally:
        log.close()
    return node


def _ranged_rows(segment: Path, split_bytes: int, skip_corrupt: bool, with_index: bool) -> list[tuple]:
    data = segment.read_bytes()
    index_path = segment.with_suffix(".index")
    entries = decode_index(index_path.read_bytes()) if with_index and index_path.exists() else []
    rows: list[tuple] = []
    for start in range(0, len(data), split_bytes):
        for chunk in decode_range("7", segment.name, lambda position, size: data[position:position + size],
                                  len(data), start, start + split_bytes, skip_corrupt, entries):
            rows.extend(chunk)
    return rows


def test_any_split_gives_the_rows_of_the_whole_file(big_segments: Path) -> None:
    segments = sorted((big_segments / "log").glob("*.log"))
    assert len(segments) >= 2 and all(s.with_suffix(".index").exists() for s in segments)
    assert len({row[2] for row in decode_segment("7", segments[0].name, segments[0].read_bytes(), False)}) > 50
    for segment in segments:
        whole = list(decode_segment("7", segment.name, segment.read_bytes(), False))
        for split_bytes in (5, 61, 700, 10_000) if segment == segments[0] else (97, 5000):
            for with_index in (True, False):
                assert _ranged_rows(segment, split_bytes, False, with_index) == whole, (split_bytes, with_index)


def test_a_corrupt_batch_is_reported_once_wherever_the_ranges_cut(big_segments: Path, tmp_path: Path) -> None:
    segment = tmp_path / sorted((big_segments / "log").glob("*.log"))[0].name
    shutil.copy(sorted((big_segments / "log").glob("*.log"))[0], segment)
    shutil.copy(sorted((big_segments / "log").glob("*.index"))[0], segment.with_suffix(".index"))
    data = bytearray(segment.read_bytes())
    positions = [p for p, _ in iter_batches(bytes(data))]
    victim = positions[len(positions) // 2]
    data[victim + 40] ^= 0xFF
    segment.write_bytes(bytes(data))
    whole = list(decode_segment("7", segment.name, bytes(data), True))
    skipped = [row for row in whole if row[15] == "skipped"]
    assert [(row[2], row[3]) for row in skipped] == [(victim, positions[positions.index(victim) + 1] - victim)]
    for split_bytes in (5, 40, victim - positions[positions.index(victim) - 1], 5000):
        for with_index in (True, False):
            assert _ranged_rows(segment, split_bytes, True, with_index) == whole, (split_bytes, with_index)
            with pytest.raises(PipelineInputError, match=f"corrupt batch at byte {victim}: CRC32C mismatch"):
                _ranged_rows(segment, split_bytes, False, with_index)


def test_spark_reads_small_ranges_like_one_pass_over_each_file(spark: SparkSession, big_segments: Path, tmp_path: Path) -> None:
    fs = HadoopFS(spark)
    nodes = discover(fs, [str(big_segments)])
    split_bytes = 12_000
    partitions = plan_ranges(nodes, split_bytes)
    assert len(partitions) > 2 * len(nodes[0].segments)  # each segment spread over several tasks
    whole = sorted(row for segment in sorted((big_segments / "log").glob("*.log"))
                   for row in decode_segment("7", segment.name, segment.read_bytes(), False))
    assert len(whole) > RECORDS
    ranged = sorted(tuple(r) for r in read_entries(spark, nodes, split_bytes=split_bytes).collect())
    assert ranged == whole
    no_index = tmp_path / "7"
    shutil.copytree(big_segments, no_index)
    for index in (no_index / "log").glob("*.index"):
        index.unlink()
    scanned = sorted(tuple(r)[1:] for r in read_entries(spark, discover(fs, [str(no_index)]),
                                                         split_bytes=split_bytes).collect())
    assert scanned == [row[1:] for row in whole]
