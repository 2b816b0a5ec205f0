"""The core's batch-size accounting matches the codec that really writes batches."""

from __future__ import annotations

import msgpack

from raft.types import BATCH_OVERHEAD_BYTES, RECORD_OVERHEAD_BYTES, Batch
from storage.batch_codec import HEADER_BYTES, encode_batch


def test_batch_overhead_is_the_codec_header() -> None:
    assert BATCH_OVERHEAD_BYTES == HEADER_BYTES


def test_record_overhead_is_the_largest_msgpack_length_prefix() -> None:
    record = b"x" * (1 << 16)  # past bin 16: the 5-byte bin 32 prefix
    assert len(msgpack.packb(record, use_bin_type=True)) - len(record) == RECORD_OVERHEAD_BYTES


def test_size_bytes_covers_the_encoded_size_of_ordinary_batches() -> None:
    for records in [(b"",), (b"a" * 100,), tuple(b"k" * n for n in range(1, 300, 7)), (b"v" * 70_000, b"w")]:
        batch = Batch(7, 2, 1_700_000_000_000, False, records)
        assert len(encode_batch(batch)) <= batch.size_bytes()
