"""POST /v1/admin/snapshot/download: take a snapshot now and stream its file, so a backup
(``metakv snapshot save``) needs no access to a node's disk.

The body is the snapshot file exactly as the node keeps it (storage/snapshot_store.py: the
SQLite database and its CRC trailer), so ``metakv snapshot restore`` checks it with the
same code a node checks a downloaded snapshot with. The file is opened before the answer
starts: retention may delete it meanwhile, and the open handle still reads it whole.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import BinaryIO

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from app.http.problems import problem_content, problem_responses
from app.service import KVService

SNAPSHOT_CHUNK_BYTES = 256 * 1024
SNAPSHOT_MEDIA_TYPE = "application/octet-stream"


async def _file_chunks(handle: BinaryIO) -> AsyncIterator[bytes]:
    """The file in chunks, each read on a worker thread (a large file must not stall the loop)."""
    try:
        while chunk := await asyncio.to_thread(handle.read, SNAPSHOT_CHUNK_BYTES):
            yield chunk
    finally:
        handle.close()


def snapshot_download_router(service: KVService) -> APIRouter:
    router = APIRouter(tags=["admin"])
    statuses = problem_responses(503)
    statuses[503]["description"] = "as POST /v1/admin/snapshot answers it; retry after Retry-After"
    statuses[507] = {"description": "the disk holding the snapshots is full; nothing was published",
                     "content": problem_content()}
    statuses[200] = {
        "description": "the snapshot file (SQLite database + 20-byte CRC trailer), taken at the "
                       "node's applied version when the request arrived or later",
        "content": {SNAPSHOT_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
        "headers": {name: {"description": description, "schema": {"type": "integer"}} for name, description in (
            ("X-Snapshot-Version", "the metadata version the snapshot holds (its end offset)"),
            ("X-Snapshot-Epoch", "the epoch of the last record it holds"),
            ("Content-Length", "the file's size in bytes"))}}

    @router.post("/v1/admin/snapshot/download", summary="Take a snapshot now and stream its file",
                 response_class=StreamingResponse, responses=statuses)
    async def snapshot_download() -> StreamingResponse:
        snapshot_id = (await service.take_snapshot())["snapshot_id"]
        handle = service.open_snapshot(snapshot_id["end_offset"], snapshot_id["epoch"])
        size_bytes = os.fstat(handle.fileno()).st_size
        return StreamingResponse(_file_chunks(handle), media_type=SNAPSHOT_MEDIA_TYPE, headers={
            "X-Snapshot-Version": str(snapshot_id["end_offset"]), "X-Snapshot-Epoch": str(snapshot_id["epoch"]),
            "Content-Length": str(size_bytes)})

    return router
