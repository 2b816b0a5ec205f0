"""The state machine's fast record decoder accepts exactly what decode_command accepts,
with the same content: replicas must agree on which records are no-ops."""

from __future__ import annotations

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.commands import CommandDecodeError, decode_command, encode_command
from storage.evaluator import decode_compact
from tests.state_machine.test_replicas_property import commands

scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 5), st.floats(0, 3),
                    st.text(max_size=3), st.binary(max_size=3))
shapes = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5), max_leaves=12)
# Near-misses of a one-op command: every position may hold a wrong type.
near_commands = st.lists(
    st.one_of(st.just(1), scalars, st.just([]), st.lists(st.lists(scalars, min_size=4, max_size=5), max_size=2)),
    min_size=4, max_size=4)


def expected(record: bytes) -> object:
    try:
        command = decode_command(record)
    except CommandDecodeError:
        return "error"
    return (
        tuple((c.key, int(c.kind), c.target) for c in command.compare),
        tuple((int(o.kind), o.key, o.value, o.content_type, o.create_version, o.lease) for o in command.success),
        tuple((int(o.kind), o.key, o.value, o.content_type, o.create_version, o.lease) for o in command.failure),
    )


def compact(record: bytes) -> object:
    try:
        return decode_compact(record)
    except CommandDecodeError:
        return "error"


@settings(max_examples=150, deadline=None)
@given(st.one_of(commands.map(encode_command), shapes.map(lambda v: msgpack.packb(v, use_bin_type=True)),
                 near_commands.map(lambda v: msgpack.packb(v, use_bin_type=True)), st.binary(max_size=20)))
def test_decode_compact_agrees_with_decode_command(record):
    assert compact(record) == expected(record)


def test_one_op_shortcut_and_its_near_misses():
    assert compact(msgpack.packb([1, [], [[1, "k", b"v", "t"]], []])) == ((), ((1, "k", b"v", "t", 0, 0),), ())
    # A cleaned PUT carries the key's create_version (a fifth op element).
    cleaned = msgpack.packb([1, [], [[1, "k", b"v", "t", 7]], []], use_bin_type=True)
    assert compact(cleaned) == expected(cleaned) == ((), ((1, "k", b"v", "t", 7, 0),), ())
    for record in ([1, [], [[9, "k", b"v", "t"]], []], [2, [], [[1, "k", b"v", "t"]], []],
                   [1, [], [[1, "k", "not bytes", "t"]], []], [True, [], [[1, "k", b"v", "t"]], []]):
        packed = msgpack.packb(record, use_bin_type=True)
        assert compact(packed) == expected(packed)
    # A bool op kind is not an int for the shortcut, but decode_command takes it as PUT.
    packed = msgpack.packb([1, [], [[True, "k", b"v", "t"]], []], use_bin_type=True)
    assert compact(packed) == expected(packed) == ((), ((1, "k", b"v", "t", 0, 0),), ())
