"""What the client's calls return: typed, immutable, each carrying the versions it is about."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Any, Literal

from metakv.errors import ServerError


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key: its value, content type, and the versions that wrote and created it."""

    key: str
    value: bytes
    content_type: str
    mod_version: int
    create_version: int
    lease: int = 0  # the lease the key is attached to (0: none)

    @property
    def text(self) -> str:
        return self.value.decode("utf-8")

    def as_json(self) -> dict[str, Any]:
        """The key as JSON members (the value a string when it is UTF-8, else base64)."""
        return {"key": self.key, **value_members(self.value), "content_type": self.content_type,
                "mod_version": self.mod_version, "create_version": self.create_version,
                **({"lease": self.lease} if self.lease else {})}


@dataclass(frozen=True, slots=True)
class PutResult:
    key: str
    version: int  # the metadata version the write produced
    created: bool


@dataclass(frozen=True, slots=True)
class DeleteResult:
    key: str
    version: int
    deleted: bool  # False: the key did not exist (the delete still took a version)


@dataclass(frozen=True, slots=True)
class ListResult:
    """Every item under a prefix (up to the limit asked for), all as of ``version``."""

    version: int
    items: list[KeyValue]
    next_key: str | None = None  # set when the limit cut the listing short


@dataclass(frozen=True, slots=True)
class Event:
    """One change a watch delivers; ``value`` is None for a delete."""

    type: Literal["put", "delete"]
    key: str
    mod_version: int
    value: bytes | None = None
    content_type: str | None = None
    reason: str | None = None  # a delete by a lease: "lease-expired" or "lease-revoked"

    def as_json(self) -> dict[str, Any]:
        members: dict[str, Any] = {"type": self.type, "key": self.key, "mod_version": self.mod_version}
        if self.value is not None:
            members.update(value_members(self.value))
            members["content_type"] = self.content_type
        if self.reason is not None:
            members["reason"] = self.reason
        return members


@dataclass(frozen=True, slots=True)
class TxnResult:
    """``succeeded``: whether every compare held (the success ops ran), else the failure ops
    ran; ``results`` are the ops' results as the API renders them (gets as ``KeyValue``
    under ``"kv"``)."""

    succeeded: bool
    version: int
    results: list[dict[str, Any]] = field(default_factory=list)
    failed_compares: list[dict[str, Any]] = field(default_factory=list)


def value_members(value: bytes) -> dict[str, str]:
    """A value as JSON members: a string when it is UTF-8, else base64 with its encoding."""
    try:
        return {"value": value.decode("utf-8")}
    except UnicodeDecodeError:
        return {"value": base64.b64encode(value).decode("ascii"), "encoding": "base64"}


def decode_value(item: dict[str, Any]) -> bytes:
    """The bytes of a rendered value (a string, or base64 with ``"encoding": "base64"``)."""
    value = item.get("value", "")
    if not isinstance(value, str):
        raise ServerError("Malformed answer", f"a value is not a string: {value!r}")
    if item.get("encoding") == "base64":
        try:
            return base64.b64decode(value, validate=True)
        except binascii.Error as exc:
            raise ServerError("Malformed answer", f"a base64 value does not decode: {exc}") from None
    return value.encode("utf-8")


def key_value_of(item: dict[str, Any]) -> KeyValue:
    """A list item or a txn get's result as a ``KeyValue``."""
    return KeyValue(str(item["key"]), decode_value(item), str(item.get("content_type", "")),
                    int(item["mod_version"]), int(item["create_version"]), int(item.get("lease") or 0))


def event_of(item: dict[str, Any]) -> Event:
    kind = item["type"]
    if kind not in ("put", "delete"):
        raise ServerError("Malformed answer", f"unknown event type {kind!r}")
    value = decode_value(item) if kind == "put" and "value" in item else None
    reason = item.get("reason")
    return Event(kind, str(item["key"]), int(item["mod_version"]), value, item.get("content_type"),
                 str(reason) if reason is not None else None)
