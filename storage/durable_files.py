"""Small files that must be replaced whole or not at all (checkpoints, quorum state).

A rename is atomic but not durable until the directory is fsynced, and the new contents
are not durable until the file is fsynced before the rename: skipping either step lets a
power loss leave an empty or half-written file under the final name.
"""

from __future__ import annotations

import os
from pathlib import Path

from storage.failpoints import NO_FAILPOINTS, Failpoints


def fsync_directory(directory: Path) -> None:
    """Make creations, renames and deletions of entries in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomically(path: Path, data: bytes, failpoints: Failpoints = NO_FAILPOINTS,
                          failpoint_prefix: str = "") -> None:
    """Write ``data`` to ``path``: temp file, fsync, rename over ``path``, fsync the directory."""
    temp_path = path.with_name(path.name + ".tmp")
    fd = os.open(temp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)
    if failpoint_prefix:
        failpoints.hit(f"{failpoint_prefix}.before_rename")
    os.replace(temp_path, path)
    if failpoint_prefix:
        failpoints.hit(f"{failpoint_prefix}.after_rename")
    fsync_directory(path.parent)
