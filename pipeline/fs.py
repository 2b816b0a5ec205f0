"""File-system access through Hadoop's FileSystem API, never through the driver's ``open``.

Why: with a cluster master the inputs live on a shared file system (HDFS, S3, NFS) that the
driver reaches through Spark's Hadoop configuration. Listing, renaming and writing the small
report files go through the same API Spark itself uses, so a path that Spark can read, the
pipeline can list, and local paths keep working under ``local[*]``.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from pyspark.sql import SparkSession


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    uri: str
    is_dir: bool
    length_bytes: int


def qualify(path: str) -> str:
    """A local path without a scheme becomes an absolute file: URI; URIs pass untouched."""
    if urlparse(path).scheme and not os.path.splitdrive(path)[0]:
        return path
    return "file://" + os.path.abspath(path)


class HadoopFS:
    def __init__(self, spark: SparkSession) -> None:
        self._jvm: Any = spark._jvm  # type: ignore[attr-defined]
        self._conf: Any = spark._jsc.hadoopConfiguration()  # type: ignore[attr-defined]

    def _path(self, uri: str) -> tuple[Any, Any]:
        path = self._jvm.org.apache.hadoop.fs.Path(uri)
        return path, path.getFileSystem(self._conf)

    def exists(self, uri: str) -> bool:
        path, fs = self._path(uri)
        return bool(fs.exists(path))

    def is_dir(self, uri: str) -> bool:
        path, fs = self._path(uri)
        return bool(fs.exists(path)) and bool(fs.getFileStatus(path).isDirectory())

    def list(self, uri: str) -> list[Entry]:
        """Children of a directory, sorted by name; [] when it does not exist."""
        path, fs = self._path(uri)
        if not fs.exists(path):
            return []
        entries = [
            Entry(str(s.getPath().getName()), str(s.getPath().toString()), bool(s.isDirectory()), int(s.getLen()))
            for s in fs.listStatus(path)
        ]
        return sorted(entries, key=lambda e: e.name)

    def delete(self, uri: str) -> None:
        path, fs = self._path(uri)
        fs.delete(path, True)

    def rename(self, source_uri: str, target_uri: str) -> None:
        source, fs = self._path(source_uri)
        target, _ = self._path(target_uri)
        if not fs.rename(source, target):
            raise OSError(f"could not move {source_uri} to {target_uri}")

    def mkdirs(self, uri: str) -> None:
        path, fs = self._path(uri)
        fs.mkdirs(path)

    def read_bytes(self, uri: str, limit_bytes: int) -> bytes:
        """A small file's bytes (at most ``limit_bytes``; longer raises OSError), read by the
        driver through Hadoop: only for metadata such as a log-start checkpoint."""
        path, fs = self._path(uri)
        length = int(fs.getFileStatus(path).getLen())
        if length > limit_bytes:
            raise OSError(f"{uri}: {length} bytes, more than the {limit_bytes} expected")
        stream = fs.open(path)
        try:
            return bytes(self._jvm.org.apache.commons.io.IOUtils.toByteArray(stream))
        finally:
            stream.close()

    def write_bytes(self, uri: str, data: bytes) -> None:
        path, fs = self._path(uri)
        stream = fs.create(path, True)
        try:
            stream.write(bytearray(data))
        finally:
            stream.close()


class StagedOutput:
    """Everything a job writes goes to a hidden sibling first and is moved into place only
    when the job succeeded, so bad input leaves nothing at ``--output``."""

    def __init__(self, fs: HadoopFS, output: str) -> None:
        self.fs = fs
        self.target_uri = qualify(output).rstrip("/")
        parent, name = self.target_uri.rsplit("/", 1)
        self.staging_uri = f"{parent}/.{name}.partial-{uuid.uuid4().hex[:12]}"

    def check_target_free(self) -> str | None:
        if self.fs.exists(self.target_uri) and self.fs.list(self.target_uri):
            return f"output {self.target_uri} already exists and is not empty"
        return None

    def path(self, relative: str) -> str:
        return f"{self.staging_uri}/{relative}"

    def commit(self) -> None:
        if self.fs.exists(self.target_uri):
            self.fs.delete(self.target_uri)  # an empty directory, checked before the job ran
        self.fs.rename(self.staging_uri, self.target_uri)

    def abort(self) -> None:
        if self.fs.exists(self.staging_uri):
            self.fs.delete(self.staging_uri)
