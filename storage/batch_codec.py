"""The on-disk (and in-snapshot) encoding of one record batch.

Layout, big-endian, 34-byte header then the body:

    length      u32   bytes after this field (header rest + body)
    magic       u8    format version, FORMAT_VERSION
    crc         u32   CRC32C of every byte after this field (header rest + body)
    base_offset i64
    epoch       i32
    count       i32   number of records
    timestamp   i64   milliseconds since the epoch, set by the leader
    flags       u8    bit 0: control batch
    body              msgpack array of ``count`` byte strings

Shared by storage/ (segment files) and pipeline/ (Spark readers): one decoder, no copies.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import crc32c
import msgpack

from raft.types import Batch

FORMAT_VERSION = 1
HEADER = struct.Struct(">IBIqiiqB")
HEADER_BYTES = HEADER.size  # 34
LENGTH_BYTES = 4
CRC_START = 9  # bytes before the CRC-covered part: length(4) + magic(1) + crc(4)
FLAG_CONTROL = 0x01
MAX_BATCH_BYTES = 64 * 1024 * 1024  # a length field above this is corruption, not a batch


class CorruptBatchError(ValueError):
    """Bytes at ``position`` are not a valid batch; ``reason`` says why."""

    def __init__(self, position: int, reason: str) -> None:
        super().__init__(f"corrupt batch at byte {position}: {reason}")
        self.position = position
        self.reason = reason


class TruncatedBatchError(CorruptBatchError):
    """The buffer ends inside a batch (a torn write at the tail)."""


@dataclass(frozen=True, slots=True)
class BatchHeader:
    total_bytes: int  # header + body
    base_offset: int
    epoch: int
    count: int
    timestamp_ms: int
    control: bool


_PREFIX = struct.Struct(">IBI")  # length, magic, crc
_FIELDS = struct.Struct(">qiiqB")  # base_offset, epoch, count, timestamp, flags


def _header(batch: Batch, body: bytes | memoryview) -> bytes:
    flags = FLAG_CONTROL if batch.control else 0
    fields = _FIELDS.pack(batch.base_offset, batch.epoch, len(batch.records), batch.timestamp_ms, flags)
    # The CRC runs over the fields and the body in two steps: the body is never copied.
    crc = crc32c.crc32c(body, crc32c.crc32c(fields))
    return _PREFIX.pack(len(fields) + len(body) + 5, FORMAT_VERSION, crc) + fields


def encode_batch(batch: Batch) -> bytes:
    body = msgpack.packb(batch.records, use_bin_type=True)
    return _header(batch, body) + body


class BatchEncoder:
    """Encodes batches for the append path without copying their bodies: the body is packed
    into one msgpack buffer kept for the encoder's life and handed out as a view, and the
    header is a separate small bytes, so the caller writes both with one ``os.writev``.

    ``encode_batch`` packs into a fresh buffer, copies it into a new bytes object and then
    joins header and body into a third: for a 1000-record batch of 256 KB that was ~0.2 ms
    of a ~1 ms append+fsync, more than the 1.3x budget over a bare write+fsync allows
    (docs/benchmarks.md, Segment log). One user at a time (the segment log calls it under its lock).
    """

    def __init__(self) -> None:
        self._packer = msgpack.Packer(autoreset=False, use_bin_type=True)

    @contextmanager
    def parts(self, batch: Batch) -> Iterator[tuple[bytes, memoryview]]:
        """(header, body) of ``batch``, valid inside the ``with`` block only."""
        packer = self._packer
        packer.reset()
        packer.pack(batch.records)
        body = packer.getbuffer()
        try:
            yield _header(batch, body), body
        finally:
            body.release()
            try:
                packer.reset()
            except BufferError:
                # A view of the body outlives the call (a failed write's traceback holds
                # the writer's views): leave that buffer to it and pack into a new one.
                self._packer = msgpack.Packer(autoreset=False, use_bin_type=True)


def decode_header(buffer: bytes | memoryview, position: int = 0) -> BatchHeader:
    """Decode and sanity-check the header at ``position`` (the CRC is checked by decode_batch)."""
    if len(buffer) - position < HEADER_BYTES:
        raise TruncatedBatchError(position, "buffer ends inside a batch header")
    length, magic, _crc, base_offset, epoch, count, timestamp_ms, flags = HEADER.unpack_from(buffer, position)
    if magic != FORMAT_VERSION:
        raise CorruptBatchError(position, f"unknown batch format version {magic}")
    if length < HEADER_BYTES - LENGTH_BYTES or length > MAX_BATCH_BYTES:
        raise CorruptBatchError(position, f"impossible batch length {length}")
    if count <= 0 or base_offset < 0 or epoch < 0 or flags & ~FLAG_CONTROL:
        raise CorruptBatchError(position, "impossible header fields")
    return BatchHeader(length + LENGTH_BYTES, base_offset, epoch, count, timestamp_ms, bool(flags & FLAG_CONTROL))


def decode_batch(buffer: bytes | memoryview, position: int = 0) -> tuple[Batch, int]:
    """Decode the batch at ``position``; return it and the position just past it."""
    header = decode_header(buffer, position)
    end = position + header.total_bytes
    if len(buffer) < end:
        raise TruncatedBatchError(position, "buffer ends inside a batch body")
    (stored_crc,) = struct.unpack_from(">I", buffer, position + 5)
    covered = bytes(buffer[position + CRC_START : end])
    if crc32c.crc32c(covered) != stored_crc:
        raise CorruptBatchError(position, "CRC32C mismatch")
    try:
        records = msgpack.unpackb(covered[HEADER_BYTES - CRC_START :], raw=False)
    except Exception as exc:
        raise CorruptBatchError(position, f"body is not msgpack: {exc}") from exc
    if type(records) is not list or len(records) != header.count or any(type(r) is not bytes for r in records):
        raise CorruptBatchError(position, "body does not hold the header's record count of byte strings")
    return Batch(header.base_offset, header.epoch, header.timestamp_ms, header.control, tuple(records)), end


def iter_batches(buffer: bytes | memoryview, position: int = 0) -> Iterator[tuple[int, Batch]]:
    """Yield (position, batch) for every batch from ``position`` to the buffer's end; raise on corruption."""
    while position < len(buffer):
        batch, next_position = decode_batch(buffer, position)
        yield position, batch
        position = next_position
