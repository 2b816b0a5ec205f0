"""GET /v1/watch: the changes after a version under a prefix, as a long-poll answer or as a
stream of Server-Sent Events (docs/http.md, GET /v1/watch)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive

from app.http.models import WatchResponse
from app.http.problems import ProblemError, history_compacted_body, problem_body, problem_responses
from app.http.render import render_event
from app.http.settings import DEFAULT_WATCH_TIMEOUT_MS, MAX_VERSION, HttpSettings, clamp_ms
from app.http.watch_limits import WatcherSlots, watcher_metrics
from app.service import ChangePage, ChangeWatch, Event, HistoryCompactedError, KVService

VERSION_TEXT_PATTERN = re.compile(r"[0-9]{1,19}")
SSE_CHUNK_BYTES = 64 * 1024  # the transport's high-water mark: a stalled client holds about this much
SSE_BLOCK_CACHE_BYTES = 16 * 1024 * 1024  # rendered events shared between streams
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request whose client closed the connection first


class SseBlocks:
    """The ``event:``/``data:`` block of each recent event, rendered once for all the streams
    it reaches (the hub shares one Event between watchers): a change under a prefix that
    1,000 streams watch is rendered once, not 1,000 times. Bounded in bytes, oldest out."""

    def __init__(self, max_bytes: int = SSE_BLOCK_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._blocks: OrderedDict[Event, bytes] = OrderedDict()
        self._bytes = 0

    def block(self, event: Event) -> bytes:
        block = self._blocks.get(event)
        if block is not None:
            return block
        rendered = render_event(event)
        block = (f"event: {rendered['type']}\ndata: ".encode()
                 + json.dumps(rendered, separators=(",", ":")).encode() + b"\n\n")
        if len(block) <= self.max_bytes // 4:
            self._blocks[event] = block
            self._bytes += len(block)
            while self._bytes > self.max_bytes:
                self._bytes -= len(self._blocks.popitem(last=False)[1])
        return block

    def chunks(self, events: list[Event], version: int) -> Iterator[bytes]:
        """One read's events as SSE blocks, in chunks of about SSE_CHUNK_BYTES (the stream
        sends each, and waits for a paused transport, before the next). The id of the last
        event of each version is a version to resume from without gaps (the last one's is
        the read's)."""
        parts: list[bytes] = []
        size_bytes = 0
        for index, event in enumerate(events):
            last = index == len(events) - 1
            if last or events[index + 1].mod_version != event.mod_version:
                event_id = version if last else event.mod_version
                parts.append(f"id: {event_id}\n".encode())
            parts.append(self.block(event))
            size_bytes += len(parts[-1])
            if size_bytes >= SSE_CHUNK_BYTES:
                yield b"".join(parts)
                parts, size_bytes = [], 0
        if parts:
            yield b"".join(parts)


async def sse_stream(watch: ChangeWatch, settings: HttpSettings, since: int, timeout_ms: int,
                     release: Callable[[], None], blocks: SseBlocks) -> AsyncIterator[bytes]:
    """Events as Server-Sent Events; the id of the last event of each read is a version
    to resume from (Last-Event-ID or since=) without gaps, even when one version holds
    several events. ``release`` frees the stream's watcher slot when it ends."""
    try:
        stream_end_s = time.monotonic() + timeout_ms / 1000
        keepalive_s = settings.sse_keepalive_ms / 1000
        yield b"retry: 1000\n\n"
        resume_id = since  # the Last-Event-ID the client holds
        while time.monotonic() < stream_end_s:
            deadline_s = min(stream_end_s, time.monotonic() + keepalive_s)
            try:
                page = await watch.next(deadline_s)
            except HistoryCompactedError as exc:
                # The watch fell behind and the horizon passed what it sent: the status is
                # sent already, so the 410 problem document travels as an event and the
                # stream ends.
                detail, extras = history_compacted_body(exc.oldest_version)
                problem = problem_body(410, "version-compacted", "Version compacted", detail, extras)
                yield b"event: error\ndata: " + problem + b"\n\n"
                return
            if not page.events:
                if watch.stopped:
                    return  # the node stopped waiting (shutting down): end the stream, clients reconnect
                since = max(since, page.version)  # nothing under the prefix up to there
                block = b""
                if since > resume_id:
                    # An id without data moves the client's Last-Event-ID without an event
                    # (WHATWG SSE), so a reconnect resumes from here: from its old id a quiet
                    # prefix's watch would meet 410 once the horizon passed that id.
                    resume_id = since
                    block += f"id: {since}\n".encode()
                if time.monotonic() < stream_end_s:
                    block += b": keepalive\n"
                if block:
                    yield block + b"\n"
                continue
            for chunk in blocks.chunks(page.events, page.version):
                yield chunk
                # Let the loop run: the transport writes what it was given at the end of a
                # turn (app/http/uvicorn_protocol.py) and only then can pause a client that
                # does not read, so the next send waits instead of rendering on. Other
                # requests get their turn too.
                await asyncio.sleep(0)
            since = resume_id = page.version
    finally:
        watch.close()
        release()


async def _disconnected(receive: Receive) -> None:
    """Return once the client has gone (a GET's empty body comes first)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(waiting: Coroutine[Any, Any, ChangePage], receive: Receive) -> ChangePage | None:
    """``waiting``'s page, or None as soon as the client disconnects: a long-poll whose
    client left frees its watcher slot then, not when its timeout ends."""
    page_task = asyncio.ensure_future(waiting)
    gone_task = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((page_task, gone_task), return_when=asyncio.FIRST_COMPLETED)
    finally:
        page_task.cancel()
        gone_task.cancel()
    if page_task.done() and not page_task.cancelled():
        return page_task.result()  # HistoryCompactedError included
    return None


def watch_router(service: KVService, settings: HttpSettings) -> APIRouter:
    router = APIRouter(tags=["keys"])
    slots = WatcherSlots(settings.max_watchers, settings.max_watchers_per_token, watcher_metrics(service.metrics))
    blocks = SseBlocks()

    @router.get("/v1/watch", summary="Changes after a version (long-poll, or SSE)",
                response_model=WatchResponse, responses={
                    200: {"description": "events (JSON), or a text/event-stream when asked for",
                          "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                    **problem_responses(400, 410, 429, 503)})
    async def watch(
        request: Request,
        prefix: Annotated[str, Query(description="only keys starting with this")] = "",
        since: Annotated[int, Query(ge=0, le=MAX_VERSION, description="answer changes newer than this version")] = 0,
        timeout_ms: Annotated[int, Query(ge=0, description="long-poll wait, or SSE stream lifetime (clamped)")] = DEFAULT_WATCH_TIMEOUT_MS,
        last_event_id: Annotated[str | None, Header(alias="Last-Event-ID", description="SSE resume: overrides since")] = None,
    ) -> Response:
        timeout_ms = clamp_ms(timeout_ms, settings.max_watch_timeout_ms)
        await service.wait_readable("local", None, 0)
        wants_sse = "text/event-stream" in request.headers.get("accept", "")
        if wants_sse and last_event_id is not None:
            # ASCII digits only (str.isdigit admits "²", which int() refuses), and within
            # the range ``since`` accepts.
            resume = last_event_id.strip()
            if not VERSION_TEXT_PATTERN.fullmatch(resume) or int(resume) > MAX_VERSION:
                raise ProblemError(400, "invalid-parameter", "Invalid Last-Event-ID",
                                   f"Last-Event-ID must be a version between 0 and {MAX_VERSION}")
            since = int(resume)
        release = slots.take(request.scope)  # 429 past the node's or the token's cap
        try:
            # Opened (its first page read) before answering, so a stale since is a 410
            # status, not an error mid-stream.
            watch = service.watch(prefix, since, settings.watch_events_max, settings.max_answer_bytes)
        except BaseException:
            release()
            raise
        if wants_sse:
            return StreamingResponse(sse_stream(watch, settings, since, timeout_ms, release, blocks),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            page = await _unless_disconnected(watch.next(time.monotonic() + timeout_ms / 1000), request.receive)
        finally:
            watch.close()
            release()
        if page is None:  # nobody to answer: the status only reaches the request metrics
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse({"version": page.version, "events": [render_event(e) for e in page.events]})

    return router
