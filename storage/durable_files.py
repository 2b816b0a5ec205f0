"""Writes that must reach the disk whole: every byte of a buffer, small files replaced
atomically (checkpoints, quorum state), and the directory entries that name them.

A rename is atomic but not durable until the directory is fsynced, and the new contents
are not durable until the file is fsynced before the rename: skipping either step lets a
power loss leave an empty or half-written file under the final name.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from pathlib import Path

from storage.failpoints import NO_FAILPOINTS, Failpoints


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Make creations, renames and deletions of entries in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all_parts(fd: int, parts: Sequence[bytes | bytearray | memoryview], position: int | None = None) -> None:
    """Write ``parts`` one after the other (``writev``, or ``pwritev`` at byte ``position``;
    no joined copy), however short the writes. A call that writes nothing and reports no
    error is an I/O error: retrying it would spin forever (in the segment log, with its
    lock held)."""
    views = [memoryview(part) for part in parts if part]
    while views:
        written = os.writev(fd, views) if position is None else os.pwritev(fd, views, position)
        if written == 0:
            raise OSError(errno.EIO, "a write of a non-empty buffer wrote no bytes")
        if position is not None:
            position += written
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


def write_file_atomically(path: Path, data: bytes, failpoints: Failpoints = NO_FAILPOINTS,
                          failpoint_prefix: str = "") -> None:
    """Write ``data`` to ``path``: temp file, fsync, rename over ``path``, fsync the directory."""
    temp_path = path.with_name(path.name + ".tmp")
    fd = os.open(temp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all_parts(fd, (data,))
        os.fsync(fd)
    finally:
        os.close(fd)
    if failpoint_prefix:
        failpoints.hit(f"{failpoint_prefix}.before_rename")
    os.replace(temp_path, path)
    if failpoint_prefix:
        failpoints.hit(f"{failpoint_prefix}.after_rename")
    fsync_directory(path.parent)
