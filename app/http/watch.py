"""GET /v1/watch: the changes after a version under a prefix, as a long-poll answer or as a
stream of Server-Sent Events (docs/http.md, GET /v1/watch)."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from app.http.models import WatchResponse
from app.http.problems import ProblemError, history_compacted_body, problem_body, problem_responses
from app.http.render import render_event
from app.http.settings import DEFAULT_WATCH_TIMEOUT_MS, MAX_VERSION, HttpSettings, clamp_ms
from app.service import Event, HistoryCompactedError, KVService

VERSION_TEXT_PATTERN = re.compile(r"[0-9]{1,19}")
WAIT_EARLY_RETURN_S = 0.005  # a change wait ending this long before its deadline was cut short


async def changes_after(service: KVService, settings: HttpSettings, prefix: str, since: int,
                        deadline_s: float) -> tuple[int, list[Event], bool]:
    """Events under ``prefix`` newer than ``since``, waiting for one until the deadline.
    The flag says the service stopped waiting well before the deadline without a new
    version (the node is closing): callers answer instead of asking again in a busy loop.

    A read that finds nothing under the prefix moves ``since`` up to the version it read
    at: nothing under the prefix changed up to there, so the next read asks only for what
    is newer. Otherwise a watch of a quiet prefix kept asking from its first version, and
    was answered 410 as soon as the history horizon passed it while other keys changed."""
    while True:
        page = service.changes(prefix, since, settings.watch_events_max)
        remaining_ms = math.ceil((deadline_s - time.monotonic()) * 1000)
        if page.events or remaining_ms <= 0:
            return page.version, list(page.events), False
        since = max(page.version, since)
        if await service.wait_for_change(since, remaining_ms) <= since:
            stopped_early = deadline_s - time.monotonic() > WAIT_EARLY_RETURN_S
            return page.version, [], stopped_early


def _sse_events(events: list[Event], version: int) -> bytes:
    """One read's events as SSE blocks; the id of the last event of each version is a
    version to resume from without gaps (the last one's is the read's version)."""
    parts = []
    for index, event in enumerate(events):
        rendered = render_event(event)
        last = index == len(events) - 1
        if last or events[index + 1].mod_version != event.mod_version:
            event_id = version if last else event.mod_version
            parts.append(f"id: {event_id}\n".encode())
        parts.append(f"event: {rendered['type']}\ndata: ".encode())
        parts.append(json.dumps(rendered, separators=(",", ":")).encode() + b"\n\n")
    return b"".join(parts)


async def sse_stream(service: KVService, settings: HttpSettings, prefix: str, since: int,
                     timeout_ms: int) -> AsyncIterator[bytes]:
    """Events as Server-Sent Events; the id of the last event of each read is a version
    to resume from (Last-Event-ID or since=) without gaps, even when one version holds
    several events."""
    stream_end_s = time.monotonic() + timeout_ms / 1000
    keepalive_s = settings.sse_keepalive_ms / 1000
    yield b"retry: 1000\n\n"
    resume_id = since  # the Last-Event-ID the client holds
    while time.monotonic() < stream_end_s:
        deadline_s = min(stream_end_s, time.monotonic() + keepalive_s)
        try:
            version, events, stopped_early = await changes_after(service, settings, prefix, since, deadline_s)
        except HistoryCompactedError as exc:
            # The horizon passed ``since`` mid-stream: the status is sent already, so the
            # 410 problem document travels as an event and the stream ends.
            detail, extras = history_compacted_body(exc.oldest_version)
            problem = problem_body(410, "version-compacted", "Version compacted", detail, extras)
            yield b"event: error\ndata: " + problem + b"\n\n"
            return
        if stopped_early:
            return  # the node stopped waiting (shutting down): end the stream, clients reconnect
        if not events:
            since = max(since, version)  # nothing under the prefix up to there
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
        yield _sse_events(events, version)
        since = resume_id = version


def watch_router(service: KVService, settings: HttpSettings) -> APIRouter:
    router = APIRouter(tags=["keys"])

    @router.get("/v1/watch", summary="Changes after a version (long-poll, or SSE)",
                response_model=WatchResponse, responses={
                    200: {"description": "events (JSON), or a text/event-stream when asked for",
                          "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                    **problem_responses(400, 410, 503)})
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
        # Checked before answering so a stale since is a 410 status, not an error mid-stream.
        page = service.changes(prefix, since, settings.watch_events_max)
        if wants_sse:
            return StreamingResponse(sse_stream(service, settings, prefix, since, timeout_ms),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        version, events = page.version, page.events
        if not events:
            version, events, _ = await changes_after(service, settings, prefix, since,
                                                     time.monotonic() + timeout_ms / 1000)
        return JSONResponse({"version": version, "events": [render_event(e) for e in events]})

    return router
