"""churn's figures equal a plain-Python computation over the same committed batches, using
the real StateMachine's apply results (created / deleted flags) as the classification."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pandas as pd
import pytest

from storage.batch_codec import encode_batch
from storage.commands import OpKind
from storage.state_machine import StateMachine
from tests.pipeline.conftest import Cluster
from tests.pipeline.helpers import run_cli

WINDOW_MS = 30_000


def _expected(cluster: Cluster, tmp_path: Path) -> tuple[dict, dict]:
    committed = [b for b in cluster.batches if b.next_offset <= cluster.committed_version]
    per_cell: dict[tuple[str, int], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    lifetimes: dict[tuple[str, int], list[int]] = defaultdict(list)
    born: dict[str, int] = {}
    live: dict[str, int] = {}
    over_time: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    with StateMachine(str(tmp_path / "expected.db")) as machine:
        for batch in committed:
            window = batch.timestamp_ms // WINDOW_MS * WINDOW_MS
            over_time[window]["log_bytes_added"] += len(encode_batch(batch))
            for result in machine.apply([batch]):
                for op in result.ops:
                    if op.kind == OpKind.GET:
                        continue
                    cell = per_cell[(op.key.split("/")[0], window)]
                    size = len(op.key.encode()) + (len(op.entry.value) if op.kind == OpKind.PUT else 0)
                    cell["written_bytes"] += size
                    over_time[window]["written_bytes_added"] += size
                    before = live.get(op.key, 0) if op.key in live else 0
                    if op.kind == OpKind.PUT:
                        cell["puts"] += 1
                        cell["creates" if op.created else "updates"] += 1
                        if op.created:
                            born[op.key] = batch.timestamp_ms
                        live[op.key] = size
                        delta = size - before
                    else:
                        cell["tombstones"] += 1
                        delta = 0
                        if op.deleted:
                            cell["deletes"] += 1
                            lifetimes[(op.key.split("/")[0], window)].append(batch.timestamp_ms - born.pop(op.key))
                            delta = -live.pop(op.key)
                    cell["live_delta"] += delta
                    over_time[window]["live_delta"] += delta
    return per_cell, {"lifetimes": lifetimes, "over_time": over_time}


def test_churn_matches_plain_python(spark, cluster: Cluster, tmp_path: Path, capsys) -> None:
    output = tmp_path / "out"
    code, _, _ = run_cli(capsys, "churn", "--input", str(cluster.node("1")), "--output", str(output),
                         "--window-ms", str(WINDOW_MS))
    assert code == 0
    per_cell, extra = _expected(cluster, tmp_path)
    table = pd.read_parquet(output / "churn.parquet").sort_values(["prefix", "window_start_ms"])
    assert set(zip(table.prefix, table.window_start_ms, strict=True)) == set(per_cell)
    running: dict[str, float] = defaultdict(float)
    for row in table.itertuples():
        cell = per_cell[(row.prefix, row.window_start_ms)]
        for name in ("creates", "updates", "deletes", "tombstones", "puts", "written_bytes"):
            assert getattr(row, name) == cell[name], (row.prefix, row.window_start_ms, name)
        running[row.prefix] += cell["live_delta"]
        assert row.live_bytes == running[row.prefix]
        ended = extra["lifetimes"].get((row.prefix, row.window_start_ms), [])
        assert row.lifetimes_ended == len(ended)
        if ended:
            assert row.lifetime_ms_mean == pytest.approx(sum(ended) / len(ended))
            assert row.lifetime_ms_max == max(ended)
        total = cell["puts"] + cell["tombstones"]
        assert row.tombstone_share == pytest.approx(cell["tombstones"] / total)
    assert sum(per_cell[c]["deletes"] for c in per_cell) > 5 and sum(len(v) for v in extra["lifetimes"].values()) > 5

    over_time = pd.read_parquet(output / "bytes_over_time.parquet").sort_values("window_start_ms")
    expected = extra["over_time"]
    assert list(over_time.window_start_ms) == sorted(expected)
    log_bytes = written = live = 0
    for row in over_time.itertuples():
        cell = expected[row.window_start_ms]
        log_bytes += cell["log_bytes_added"]
        written += cell["written_bytes_added"]
        live += cell["live_delta"]
        assert (row.log_bytes, row.written_bytes, row.live_bytes) == (log_bytes, written, live)
    for name in ("summary.md", "churn.png", "bytes.png"):
        assert (output / name).stat().st_size > 100
    assert (output / "churn.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
