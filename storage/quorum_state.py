"""The ``quorum-state`` file: the epoch, vote and known leader a node must never forget.

A node that forgets its vote can vote twice in one epoch and elect two leaders, so the file
is replaced atomically and durably (temp file, fsync, rename, directory fsync) before the
core may act on the new state. A missing file means a fresh node; an unreadable one is never
guessed at: startup stops with an error naming the file and the byte where parsing failed.

Two flags let a voter tell that its log was lost (raft/roles.py rule 12): ``log_acknowledged``
(it acknowledged records of its log) and ``log_lost`` (it then found the log empty, and has
not caught up since). A file from before the flags has only the first three fields; it is
read as acknowledged when its epoch is above 0, so an empty log next to it is taken as lost:
the node waits to catch up instead of voting with nothing (a wrong guess costs only time).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from pathlib import Path

from raft.log import QuorumStateRecord
from storage.durable_files import write_file_atomically
from storage.failpoints import Failpoints

QUORUM_STATE_FILE_NAME = "quorum-state"
_FIELDS = ("epoch", "voted_id", "leader_id")
_FLAGS = ("log_acknowledged", "log_lost")


class CorruptQuorumStateError(Exception):
    """The quorum-state file exists but does not hold a valid record."""

    def __init__(self, path: Path, position: int, reason: str) -> None:
        self.path = path
        self.position = position
        super().__init__(
            f"corrupt quorum-state file {path} at byte {position}: {reason}. It holds this node's "
            "epoch and vote; do not delete it while the node is a voter (it could vote twice). "
            "Restore it from a backup, or remove the node from the quorum and wipe its data directory."
        )


class QuorumStateFile:
    """Reads and durably writes ``<data-dir>/quorum-state``."""

    def __init__(self, data_dir: str | os.PathLike[str], failpoints: Failpoints | None = None) -> None:
        self.path = Path(data_dir) / QUORUM_STATE_FILE_NAME
        self._failpoints = failpoints if failpoints is not None else Failpoints.from_env()

    def read(self) -> QuorumStateRecord | None:
        """The stored record, or None when the file does not exist (a node that never voted)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        return decode_quorum_state(data, self.path)

    def write(self, record: QuorumStateRecord) -> None:
        """Replace the file; durable when this returns."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomically(self.path, encode_quorum_state(record), self._failpoints, "quorum_state")


def encode_quorum_state(record: QuorumStateRecord) -> bytes:
    value: dict[str, object] = {name: getattr(record, name) for name in _FIELDS + _FLAGS}
    if record.voters:  # committed voters records (raft/roles.py rule 13), only once there are any
        value["voters"] = [[offset, base64.b64encode(data).decode()] for offset, data in record.voters]
    return json.dumps(value).encode() + b"\n"


def decode_quorum_state(data: bytes, path: Path) -> QuorumStateRecord:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptQuorumStateError(path, exc.start, "not UTF-8 text") from exc
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CorruptQuorumStateError(path, len(text[: exc.pos].encode()), f"not JSON ({exc.msg})") from exc
    voters = _decode_voters(value.pop("voters", []) if isinstance(value, dict) else [], path)
    if not isinstance(value, dict) or set(value) not in (set(_FIELDS), set(_FIELDS + _FLAGS)):
        raise CorruptQuorumStateError(path, 0, f"expected a JSON object with exactly the fields {list(_FIELDS)}, "
                                               f"and optionally {list(_FLAGS)}")
    for name in _FIELDS:
        field_value = value[name]
        if type(field_value) is not int:
            raise CorruptQuorumStateError(path, 0, f"field {name!r} is {field_value!r}, not an integer")
    for name in _FLAGS:
        if name in value and type(value[name]) is not bool:
            raise CorruptQuorumStateError(path, 0, f"field {name!r} is {value[name]!r}, not true or false")
    if value["epoch"] < 0 or value["voted_id"] < -1 or value["leader_id"] < -1:
        raise CorruptQuorumStateError(path, 0, f"impossible values {value}")
    log_acknowledged = value.get("log_acknowledged", value["epoch"] > 0)
    if value.get("log_lost", False) and not log_acknowledged:
        raise CorruptQuorumStateError(path, 0, f"impossible values {value}: log_lost without log_acknowledged")
    return QuorumStateRecord(value["epoch"], value["voted_id"], value["leader_id"],
                             log_acknowledged, value.get("log_lost", False), voters)


def _decode_voters(value: object, path: Path) -> tuple[tuple[int, bytes], ...]:
    try:
        if type(value) is not list or not all(
                type(item) is list and len(item) == 2 and type(item[0]) is int and type(item[1]) is str
                for item in value):
            raise ValueError("not a list of [offset, base64]")
        return tuple((offset, base64.b64decode(data, validate=True)) for offset, data in value)
    except (ValueError, binascii.Error) as exc:
        raise CorruptQuorumStateError(path, 0, f"field 'voters' is not a list of [offset, base64]: {exc}") from exc

