"""The wire and disk codecs: round trips, and garbage rejected with a clear error, never a crash."""

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raft.log import MemoryLog
from raft.messages import (
    DescribeQuorumRequest,
    FetchRequest,
    FetchResponse,
    MessageDecodeError,
    VoteRequest,
    decode_message,
    encode_message,
)
from raft.types import Batch, ErrorCode, SnapshotId
from storage.batch_codec import (
    BatchEncoder,
    CorruptBatchError,
    TruncatedBatchError,
    decode_batch,
    encode_batch,
    iter_batches,
)
from storage.commands import (
    Command,
    CommandDecodeError,
    Compare,
    CompareKind,
    Op,
    OpKind,
    decode_command,
    encode_command,
)

batches = st.builds(
    Batch,
    base_offset=st.integers(0, 2**40), epoch=st.integers(0, 2**20), timestamp_ms=st.integers(0, 2**45),
    control=st.booleans(), records=st.lists(st.binary(max_size=64), min_size=1, max_size=8).map(tuple),
)


@given(batches)
def test_batch_round_trip(batch: Batch) -> None:
    data = encode_batch(batch)
    decoded, end = decode_batch(data)
    assert decoded == batch and end == len(data)


_ENCODER = BatchEncoder()


@given(st.lists(batches, min_size=1, max_size=4))
def test_the_append_path_encoder_writes_the_bytes_encode_batch_writes(in_order: list[Batch]) -> None:
    """The segment log's encoder (one reused buffer, header and body apart) gives every
    batch exactly encode_batch's bytes, whatever it encoded before."""
    for batch in in_order:
        with _ENCODER.parts(batch) as (header, body):
            assert header + bytes(body) == encode_batch(batch)


def test_flipped_bit_and_torn_tail_are_detected() -> None:
    data = encode_batch(Batch(0, 1, 5, False, (b"a" * 100, b"b")))
    for position in range(9, len(data)):
        flipped = bytearray(data)
        flipped[position] ^= 0x10
        with pytest.raises(CorruptBatchError):
            decode_batch(bytes(flipped))
    with pytest.raises(TruncatedBatchError):
        decode_batch(data[:-1])
    assert [b for _, b in iter_batches(data + data)] == [decode_batch(data)[0]] * 2


def test_message_round_trip_and_garbage() -> None:
    messages = [
        VoteRequest(3, 1, 2, 10, True),
        FetchRequest(3, 2, 10, 2, 7, 500, "http://127.0.0.1:8002"),
        FetchResponse(ErrorCode.NONE, 3, 1, "http://x", 10, 9, 0, 4, 2,
                      (Batch(10, 3, 1, False, (b"r",)),), -1, 0, SnapshotId(8, 2)),
        DescribeQuorumRequest(),
    ]
    for message in messages:
        assert decode_message(encode_message(message)) == message
    rng = random.Random(7)
    for _ in range(2000):
        garbage = rng.randbytes(rng.randrange(0, 40))
        try:
            decode_message(garbage)
        except MessageDecodeError:
            pass
    for bad in (b"\x92\x63\x00", b"\x91\x07", encode_message(messages[1])[:-3]):
        with pytest.raises(MessageDecodeError):
            decode_message(bad)


def test_command_round_trip_and_rejects() -> None:
    command = Command(
        (Compare("a", CompareKind.MOD_VERSION, 4), Compare("b", CompareKind.EXISTS, False)),
        (Op(OpKind.PUT, "a", b"1", "text/plain"), Op(OpKind.GET, "b")),
        (Op(OpKind.DELETE, "a"),),
    )
    assert decode_command(encode_command(command)) == command
    with pytest.raises(CommandDecodeError):
        decode_command(b"\x94\x02\x90\x90\x90")  # unknown command version


def test_memory_log_reopen_keeps_only_flushed() -> None:
    log = MemoryLog()
    log.append(Batch(0, 1, 0, False, (b"a", b"b")))
    log.flush()
    log.append(Batch(2, 1, 0, False, (b"c",)))
    assert log.reopen().end_offset() == 2
    log.truncate_to(1)
    log.append(Batch(1, 2, 0, False, (b"x",)))
    reopened = log.reopen()
    assert reopened.end_offset() == 1 and reopened.read(0, 100)[0].records == (b"a",)
    assert log.end_offset_for_epoch(1) == (1, 1) and log.end_offset_for_epoch(5) == (2, 2)
