"""The quorum-state file: durable round trips, and a clear error for anything unreadable."""

from __future__ import annotations

from pathlib import Path

import pytest

from raft.log import QuorumStateRecord
from storage.failpoints import Failpoints
from storage.quorum_state import CorruptQuorumStateError, QuorumStateFile


def test_missing_file_means_a_fresh_node(tmp_path: Path) -> None:
    assert QuorumStateFile(tmp_path).read() is None


def test_round_trip_and_replace(tmp_path: Path) -> None:
    store = QuorumStateFile(tmp_path)
    store.write(QuorumStateRecord(3, 2, -1))
    store.write(QuorumStateRecord(4, -1, 1))
    assert QuorumStateFile(tmp_path).read() == QuorumStateRecord(4, -1, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quorum-state"]


@pytest.mark.parametrize(
    ("content", "position", "reason"),
    [
        (b"", 0, "not JSON"),
        (b'{"epoch": 3, "voted_id": 2, "leader', 28, "not JSON"),
        (b'{"epoch": 3, "voted_id": 2, "leader_id": -1}\x00\x00', 44, "not JSON"),
        (b"\xff\xfe garbage", 0, "not UTF-8"),
        (b'{"epoch": 3, "voted_id": 2}', 0, "exactly the fields"),
        (b'{"epoch": "3", "voted_id": 2, "leader_id": -1}', 0, "not an integer"),
        (b'{"epoch": -4, "voted_id": 2, "leader_id": -1}', 0, "impossible values"),
        (b"[3, 2, -1]", 0, "exactly the fields"),
    ],
)
def test_garbage_file_is_a_clear_startup_error(tmp_path: Path, content: bytes, position: int, reason: str) -> None:
    (tmp_path / "quorum-state").write_bytes(content)
    with pytest.raises(CorruptQuorumStateError) as caught:
        QuorumStateFile(tmp_path).read()
    message = str(caught.value)
    assert str(tmp_path / "quorum-state") in message and f"at byte {position}" in message and reason in message
    assert (tmp_path / "quorum-state").read_bytes() == content  # nothing was "repaired"


def test_failed_write_keeps_the_previous_state(tmp_path: Path) -> None:
    QuorumStateFile(tmp_path).write(QuorumStateRecord(5, 1, 1))
    failing = QuorumStateFile(tmp_path, Failpoints("quorum_state.before_rename=error"))
    with pytest.raises(OSError, match="injected I/O error"):
        failing.write(QuorumStateRecord(6, 2, -1))
    assert QuorumStateFile(tmp_path).read() == QuorumStateRecord(5, 1, 1)
    QuorumStateFile(tmp_path).write(QuorumStateRecord(6, 2, -1))  # the leftover temp file is no obstacle
    assert QuorumStateFile(tmp_path).read() == QuorumStateRecord(6, 2, -1)


def test_log_flags_round_trip(tmp_path: Path) -> None:
    store = QuorumStateFile(tmp_path)
    for record in (QuorumStateRecord(3, 2, -1, log_acknowledged=True),
                   QuorumStateRecord(4, -1, 1, log_acknowledged=True, log_lost=True)):
        store.write(record)
        assert QuorumStateFile(tmp_path).read() == record


@pytest.mark.parametrize(("epoch", "acknowledged"), [(0, False), (3, True)])
def test_a_file_from_before_the_log_flags_counts_as_acknowledged_above_epoch_0(
        tmp_path: Path, epoch: int, acknowledged: bool) -> None:
    """Unknown is taken as acknowledged: an empty log next to it then waits to catch up
    instead of voting with nothing (docs/raft.md, A lost log)."""
    (tmp_path / "quorum-state").write_bytes(b'{"epoch": %d, "voted_id": 2, "leader_id": -1}\n' % epoch)
    assert QuorumStateFile(tmp_path).read() == QuorumStateRecord(epoch, 2, -1, log_acknowledged=acknowledged)


@pytest.mark.parametrize(("content", "reason"), [
    (b'{"epoch": 3, "voted_id": 2, "leader_id": -1, "log_acknowledged": 1, "log_lost": false}', "not true or false"),
    (b'{"epoch": 3, "voted_id": 2, "leader_id": -1, "log_acknowledged": false, "log_lost": true}', "log_lost without"),
    (b'{"epoch": 3, "voted_id": 2, "leader_id": -1, "log_lost": true}', "exactly the fields"),
])
def test_bad_log_flags_are_a_clear_startup_error(tmp_path: Path, content: bytes, reason: str) -> None:
    (tmp_path / "quorum-state").write_bytes(content)
    with pytest.raises(CorruptQuorumStateError, match=reason):
        QuorumStateFile(tmp_path).read()
