"""The write side of ``KVService``: typed put, delete and txn as one storage command each.

Why a module of its own: the runtime (and its in-process test twin) replicate a write as one
log record, a storage.commands Command, through their own ``propose``. Both inherit these
methods, so front ends never build a Command and the two cannot spell writes differently.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from app.service import DEFAULT_CONTENT_TYPE, ApplyResult, Compare, Op
from storage import commands


class NodeWrites:
    """put, delete and txn of ``KVService``, each one ``self.propose`` of a Command."""

    # Replicate and apply one command; return its result (the implementer's write path).
    propose: Callable[[commands.Command], Awaitable[ApplyResult]]

    async def put(self, key: str, value: bytes, content_type: str = DEFAULT_CONTENT_TYPE,
                  compares: tuple[Compare, ...] = ()) -> ApplyResult:
        return await self.propose(commands.put(key, value, content_type, compares))

    async def delete(self, key: str, compares: tuple[Compare, ...] = ()) -> ApplyResult:
        return await self.propose(commands.delete(key, compares))

    async def txn(self, compares: tuple[Compare, ...], success: tuple[Op, ...],
                  failure: tuple[Op, ...] = ()) -> ApplyResult:
        return await self.propose(commands.Command(compares, success, failure))
