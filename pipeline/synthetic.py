"""A seeded metadata workload as log batches, for the pipeline's tests and its benchmark.

Why here and not in tests/: the benchmark (loadtest/bench_pipeline.py) needs the same
workload at 10 million records. The batches are encoded with storage/batch_codec.py and the
records with storage/commands.py, exactly what a node writes; conditional txns compare
against versions that sometimes still hold and sometimes no longer do, so both branches run.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from dataclasses import dataclass

from raft.types import CONTROL_LEADER_CHANGE, Batch, encode_control_record
from storage.batch_codec import encode_batch
from storage.commands import Command, Compare, CompareKind, Op, OpKind, delete, encode_command, put

PREFIXES = ("users", "jobs", "config", "locks")
SEGMENT_BYTES_DEFAULT = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class WorkloadShape:
    keys_per_prefix: int = 20
    records_per_batch_max: int = 4
    value_bytes_max: int = 48
    epoch_change_every_batches: int = 40
    timestamp_step_ms_max: int = 2_000
    txn_share: float = 0.2
    delete_share: float = 0.2


class _Model:
    """Just enough state to write compares that sometimes hold."""

    def __init__(self) -> None:
        self.mod_version: dict[str, int] = {}
        self.value: dict[str, bytes] = {}


def _command(rng: random.Random, shape: WorkloadShape, model: _Model, offset: int) -> Command:
    key = f"{rng.choice(PREFIXES)}/k{rng.randrange(shape.keys_per_prefix):03d}"
    value = rng.randbytes(rng.randrange(shape.value_bytes_max + 1))
    roll = rng.random()
    if roll < shape.delete_share:
        return delete(key)
    if roll < shape.delete_share + shape.txn_share:
        other = f"{rng.choice(PREFIXES)}/k{rng.randrange(shape.keys_per_prefix):03d}"
        kind = rng.choice(list(CompareKind))
        if kind == CompareKind.MOD_VERSION:
            current = model.mod_version.get(key, 0)
            target: int | bool | bytes = current if rng.random() < 0.6 else current + 1
        elif kind == CompareKind.EXISTS:
            target = rng.random() < 0.5
        else:
            current_value = model.value.get(key, b"")
            target = current_value if rng.random() < 0.6 else b"nope"
        success = (Op(OpKind.PUT, other, value, "application/json"), Op(OpKind.GET, key),
                   Op(OpKind.DELETE, key) if rng.random() < 0.3 else Op(OpKind.PUT, key, value[::-1], "text/plain"))
        failure = (Op(OpKind.PUT, f"{other}-failed", value),) if rng.random() < 0.5 else ()
        return Command((Compare(key, kind, target),), success, failure)
    content_type = rng.choice(("application/octet-stream", "application/json", "text/plain"))
    return put(key, value, content_type)


def _track(model: _Model, command: Command, offset: int) -> None:
    """Approximate: assumes success; only steers the compares, never the truth."""
    for op in command.success:
        if op.kind == OpKind.PUT:
            model.mod_version[op.key] = offset + 1
            model.value[op.key] = op.value
        elif op.kind == OpKind.DELETE:
            model.mod_version.pop(op.key, None)
            model.value.pop(op.key, None)


def workload(seed: int, records: int, shape: WorkloadShape = WorkloadShape(),
             start_timestamp_ms: int = 1_700_000_000_000) -> Iterator[Batch]:
    """Batches holding ``records`` offsets in all (control batches included)."""
    rng = random.Random(seed)
    model = _Model()
    offset, epoch, timestamp_ms, batches = 0, 1, start_timestamp_ms, 0
    while offset < records:
        timestamp_ms += rng.randrange(1, shape.timestamp_step_ms_max)
        if batches % shape.epoch_change_every_batches == 0:
            if batches:
                epoch += 1
            record = encode_control_record(CONTROL_LEADER_CHANGE, leader_id=1 + epoch % 3, voters=[1, 2, 3])
            yield Batch(offset, epoch, timestamp_ms, True, (record,))
            offset += 1
            batches += 1
            continue
        count = min(rng.randrange(1, shape.records_per_batch_max + 1), records - offset)
        encoded = []
        for index in range(count):
            command = _command(rng, shape, model, offset + index)
            _track(model, command, offset + index)
            encoded.append(encode_command(command))
        yield Batch(offset, epoch, timestamp_ms, False, tuple(encoded))
        offset += count
        batches += 1


def write_segments(log_dir: str, batches: Iterator[Batch] | list[Batch],
                   segment_bytes: int = SEGMENT_BYTES_DEFAULT) -> list[str]:
    """Write batches as segment files named by their first base offset; return the paths."""
    os.makedirs(log_dir, exist_ok=True)
    paths: list[str] = []
    handle = None
    written = 0
    try:
        for batch in batches:
            data = encode_batch(batch)
            if handle is None or written + len(data) > segment_bytes:
                if handle is not None:
                    handle.close()
                paths.append(os.path.join(log_dir, f"{batch.base_offset:020d}.log"))
                handle = open(paths[-1], "wb")  # noqa: SIM115 - rolled by hand across iterations
                written = 0
            handle.write(data)
            written += len(data)
    finally:
        if handle is not None:
            handle.close()
    return paths
