"""Who may use a data directory: one process at a time, and one node of one cluster,
and which replica it is.

Two processes on one data directory append to the same segments and apply to the same
state.db: acknowledged writes are lost and the node no longer starts (seen: a second
``serve`` on a running node's directory, or a ``repair`` of a running node). ``DataDirLock``
takes an exclusive ``flock`` on ``<data-dir>/LOCK`` for as long as the process uses the
directory; a second process is refused with the pid of the first.

A directory copied from another node or another cluster would be adopted silently (its
keys served as this cluster's, its vote record taken for this node's, which may let one
node vote twice in an epoch). ``check_identity`` records the cluster id and node id in
``<data-dir>/identity.json`` at the first start and refuses a later start under another.
It also holds the directory id (KIP-853): random, made with the directory (or at the first
start of a directory from before it), never changed. A voter is (node id, directory id), so
a node whose directory was replaced is a new replica, an observer until it is added.

The directory is 0700 (``make_private_data_dir``); ``serve``'s umask 0o077 keeps the files in it 0600.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import uuid
from pathlib import Path

from raft.voters import is_directory_id
from storage.durable_files import write_file_atomically

DATA_DIR_MODE = 0o700  # as etcd: the keys, tokens' effects and votes are the owner's only
LOCK_FILE_NAME = "LOCK"
IDENTITY_FILE_NAME = "identity.json"
IDENTITY_MAX_BYTES = 64 * 1024


class DataDirError(Exception):
    """The data directory cannot be used by this process: one line saying why and what to do."""


def make_private_data_dir(data_dir: Path) -> None:
    """Create ``data_dir`` if needed and make it the owner's only (also one made earlier with
    wider permissions: what it holds then becomes unreachable to others)."""
    data_dir.mkdir(parents=True, exist_ok=True, mode=DATA_DIR_MODE)
    os.chmod(data_dir, DATA_DIR_MODE)


class DataDirLock:
    """An exclusive lock on a data directory, held until ``close`` (or the process ends:
    the kernel drops a flock with the last descriptor, so a SIGKILLed node leaves none)."""

    def __init__(self, data_dir: Path) -> None:
        path = data_dir / LOCK_FILE_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_pid(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise DataDirError(f"{path}: cannot lock the data directory: {exc.strerror}") from None
            raise DataDirError(
                f"{data_dir} is in use by another process{f' (pid {holder})' if holder else ''}: "
                f"stop it first; two processes on one data directory lose acknowledged writes") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None


def _read_pid(fd: int) -> int | None:
    text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    return int(text) if text.isdecimal() else None


def refetch_from_leader(data_dir: Path) -> str:
    """The way out when this node's log or state cannot be rebuilt from what it holds.

    Safe because quorum-state stays: besides the vote, it records that this voter
    acknowledged records, so the node finds its log lost and neither votes nor stands for
    election until it has caught up (raft/roles.py rule 12). Deleting quorum-state too would
    make it a fresh voter that votes with an empty log, and lose committed writes."""
    quoted = shlex.quote(str(data_dir))
    return (f"with the node stopped, move {quoted}/log, {quoted}/snapshots and {quoted}/state.db (with any "
            f"state.db-wal and state.db-shm) away, keep {quoted}/quorum-state (and identity.json), and restart: "
            "the node fetches a snapshot and the log from the leader, and neither votes nor stands for election "
            "until it has caught up (quorum-state tells it that its log was lost: never delete it). Do this on "
            "one voter at a time while a majority of the other voters is up; a lone voter has no leader to fetch "
            "from: restore the directory from a backup instead")


def check_identity(data_dir: Path, cluster_id: str, node_id: int) -> str:
    """Record (cluster id, node id, a new directory id) in a data directory that has none;
    refuse one that names another node or cluster. Returns the directory id. A directory from
    before this check has no record and is taken as this node's; one from before directory
    ids gets one now, kept from then on."""
    path = data_dir / IDENTITY_FILE_NAME
    if not path.exists():
        return _write_identity(path, cluster_id, node_id)
    raw = path.read_bytes()[:IDENTITY_MAX_BYTES]
    try:
        recorded = json.loads(raw)
    except ValueError as exc:
        position = getattr(exc, "pos", 0)
        raise DataDirError(f"{path}: not a data directory identity at byte {position}: {exc}; if this is "
                           f"node {node_id}'s directory of cluster {cluster_id!r}, delete the file "
                           f"(it is written again at the next start)") from None
    if not isinstance(recorded, dict) or not isinstance(recorded.get("cluster_id"), str) \
            or type(recorded.get("node_id")) is not int:
        raise DataDirError(f"{path}: not a data directory identity (expected cluster_id and node_id); if "
                           f"this is node {node_id}'s directory of cluster {cluster_id!r}, delete the file")
    if (recorded["cluster_id"], recorded["node_id"]) != (cluster_id, node_id):
        raise DataDirError(
            f"{data_dir} belongs to node {recorded['node_id']} of cluster {recorded['cluster_id']!r}, "
            f"not node {node_id} of cluster {cluster_id!r}: start that node with it, or give this "
            f"node an empty data directory (it fetches what it needs from the leader)")
    directory_id = recorded.get("directory_id")
    if directory_id is None:
        return _write_identity(path, cluster_id, node_id)
    if type(directory_id) is not str or not is_directory_id(directory_id):
        raise DataDirError(f"{path}: directory_id {directory_id!r} is not 32 lowercase hex digits; restore the "
                           f"file, or delete it to make this directory a new replica (a voter must be added again)")
    return directory_id


def _write_identity(path: Path, cluster_id: str, node_id: int) -> str:
    directory_id = uuid.uuid4().hex
    write_file_atomically(path, json.dumps(
        {"cluster_id": cluster_id, "node_id": node_id, "directory_id": directory_id}).encode())
    return directory_id
