"""Service results as JSON members: entries, watch events and txn op results, with values
as strings for textual content types and base64 for the rest (docs/http.md, GET /v1/kv)."""

from __future__ import annotations

import binascii
import functools
from typing import Any

from app.service import DEFAULT_CONTENT_TYPE, Entry, Event, OpKind, OpResult

# Content types whose values the list and watch routes render as JSON strings.
_TEXTUAL_TYPES = frozenset({
    "application/json", "application/xml", "application/javascript", "application/yaml",
    "application/x-yaml", "application/toml", "application/x-www-form-urlencoded",
    "application/x-ndjson",
})


# A list page renders one value per entry, mostly of a few content types: parse each once.
TEXTUAL_CACHE_SIZE = 256


@functools.lru_cache(maxsize=TEXTUAL_CACHE_SIZE)
def _is_textual(content_type: str) -> bool:
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type.startswith("text/") or media_type in _TEXTUAL_TYPES or media_type.endswith(("+json", "+xml"))


def render_value(value: bytes, content_type: str) -> dict[str, Any]:
    """A value as JSON members: a string for textual content types, else base64."""
    if _is_textual(content_type):
        try:
            return {"value": value.decode("utf-8")}
        except UnicodeDecodeError:
            pass
    return {"value": binascii.b2a_base64(value, newline=False).decode("ascii"), "encoding": "base64"}


def render_entry(entry: Entry, keys_only: bool = False) -> dict[str, Any]:
    item: dict[str, Any] = {"key": entry.key, "content_type": entry.content_type,
                            "mod_version": entry.mod_version, "create_version": entry.create_version}
    if entry.lease:
        item["lease"] = entry.lease
    if not keys_only:
        item.update(render_value(entry.value, entry.content_type))
    return item


def _event_type(event: Event) -> str:
    kind = event.type
    name = getattr(kind, "name", None) or getattr(kind, "value", None) or kind
    return str(name).lower()


def render_event(event: Event) -> dict[str, Any]:
    kind = _event_type(event)
    rendered: dict[str, Any] = {"type": kind, "key": event.key, "mod_version": event.mod_version}
    if kind == "put" and event.value is not None:
        content_type = event.content_type or DEFAULT_CONTENT_TYPE
        rendered["content_type"] = content_type
        rendered.update(render_value(event.value, content_type))
    elif event.reason:
        rendered["reason"] = event.reason
    return rendered


def _op_kind_name(kind: Any) -> str:
    return {OpKind.PUT: "put", OpKind.DELETE: "delete", OpKind.GET: "get"}[OpKind(kind)]


def render_op_result(result: OpResult) -> dict[str, Any]:
    kind = _op_kind_name(result.kind)
    rendered: dict[str, Any] = {"op": kind, "key": result.key}
    if kind == "put":
        rendered["created"] = bool(result.created)
    elif kind == "delete":
        rendered["deleted"] = bool(result.deleted)
    else:
        rendered["found"] = result.entry is not None
        if result.entry is not None:
            rendered.update(render_entry(result.entry))
    return rendered
