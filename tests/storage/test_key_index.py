"""The in-memory key index: heads round-trip, and the index stays out of the collector."""

from __future__ import annotations

import gc

from hypothesis import given
from hypothesis import strategies as st

from storage.key_index import HeadIndex, pack_head, unpack_head

VERSIONS = st.integers(min_value=0, max_value=2**63 - 1)
SEQS = st.integers(min_value=0, max_value=2**32 - 1)


@given(VERSIONS, VERSIONS, SEQS, VERSIONS)
def test_a_packed_head_unpacks_to_itself(create_version: int, version: int, seq: int, key_version: int) -> None:
    head = (create_version, version, seq, key_version)
    assert unpack_head(pack_head(head)) == head


def test_heads_read_back_in_key_order_after_updates_and_forgets() -> None:
    index = HeadIndex()
    index.load({"b": (3, 3, 0, 1), "a": (1, 1, 0, 1)})
    index.update({"c": (0, 7, 2, 0), "a": (1, 8, 1, 2)})
    index.forget_deletes([("c", 7, 2), ("b", 9, 0)])  # b's head is a put: kept
    assert index.get("a") == (1, 8, 1, 2)
    assert index.get("c") is None and "c" not in index
    assert list(index.range("", None)) == [("a", (1, 8, 1, 2)), ("b", (3, 3, 0, 1))]
    assert index.as_dict() == {"a": (1, 8, 1, 2), "b": (3, 3, 0, 1)}
    assert len(index) == 2


def test_updating_heads_never_hands_the_index_to_the_garbage_collector() -> None:
    """A tracked container of a million heads costs every young collection a walk over it
    (a 21 ms stall at 1 M keys): no container the index keeps per key may be tracked."""
    index = HeadIndex()
    index.load({f"k{number:05d}": (number, number, 0, 1) for number in range(2000)})
    for round_number in range(3):
        index.update({f"k{number:05d}": (number, 5000 + round_number, number % 7, 2 + round_number)
                      for number in range(0, 2000, 3)})
        per_key_dicts = [held for held in vars(index).values() if isinstance(held, dict)]
        assert per_key_dicts and not any(gc.is_tracked(held) for held in per_key_dicts)
