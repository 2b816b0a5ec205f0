"""A transaction builder: compares, then the ops to run when they all hold, else others.

    result = (client.txn()
              .when_version("locks/a", 0)          # the key does not exist
              .then_put("locks/a", "me")
              .else_get("locks/a")
              .commit())
"""

from __future__ import annotations

import base64
from typing import Any, Self

from metakv.leases import LeaseCore, lease_id_of
from metakv.protocol import Request, txn_request, value_bytes


def _value_members(value: bytes | str) -> dict[str, str]:
    if isinstance(value, str):
        return {"value": value}
    return {"value": base64.b64encode(value).decode("ascii"), "encoding": "base64"}


def _put_op(key: str, value: bytes | str, content_type: str | None, lease: int | LeaseCore | None) -> dict[str, Any]:
    _, media_type = value_bytes(value, content_type)
    op: dict[str, Any] = {"op": "put", "key": key, **_value_members(value)}
    if media_type:
        op["content_type"] = media_type
    if lease is not None:
        op["lease"] = lease_id_of(lease)
    return op


class TxnBuilder:
    """The body of ``POST /v1/txn``, built one call at a time; ``commit`` (on the client's
    subclass) sends it. All of it is one log record: atomic on every node."""

    def __init__(self) -> None:
        self.compare: list[dict[str, Any]] = []
        self.success: list[dict[str, Any]] = []
        self.failure: list[dict[str, Any]] = []

    def when_version(self, key: str, mod_version: int) -> Self:
        """The key's mod_version is ``mod_version`` (0: the key does not exist)."""
        self.compare.append({"key": key, "mod_version": mod_version})
        return self

    def when_exists(self, key: str, exists: bool = True) -> Self:
        self.compare.append({"key": key, "exists": exists})
        return self

    def when_value(self, key: str, value: bytes | str) -> Self:
        self.compare.append({"key": key, **_value_members(value)})
        return self

    def then_put(self, key: str, value: bytes | str, content_type: str | None = None,
                 lease: int | LeaseCore | None = None) -> Self:
        """``lease``: attach the key to it (a ``Lease`` or its id)."""
        self.success.append(_put_op(key, value, content_type, lease))
        return self

    def then_delete(self, key: str) -> Self:
        self.success.append({"op": "delete", "key": key})
        return self

    def then_get(self, key: str) -> Self:
        self.success.append({"op": "get", "key": key})
        return self

    def else_put(self, key: str, value: bytes | str, content_type: str | None = None,
                 lease: int | LeaseCore | None = None) -> Self:
        self.failure.append(_put_op(key, value, content_type, lease))
        return self

    def else_delete(self, key: str) -> Self:
        self.failure.append({"op": "delete", "key": key})
        return self

    def else_get(self, key: str) -> Self:
        self.failure.append({"op": "get", "key": key})
        return self

    def body(self) -> dict[str, Any]:
        return {"compare": self.compare, "success": self.success, "failure": self.failure}

    def request(self) -> Request:
        return txn_request(self.body())
