"""The write side of ``KVService``: typed put, delete and txn as one storage command each.

Why a module of its own: the runtime (and its in-process test twin) replicate a write as one
log record, a storage.commands Command, through their own ``propose``. Both inherit these
methods, so front ends never build a Command and the two cannot spell writes differently.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from app.leases import lease_not_found
from app.service import DEFAULT_CONTENT_TYPE, ApplyResult, Compare, LeaseNotFoundError, Op, OpKind
from storage import commands


class NodeWrites:
    """put, delete and txn of ``KVService``, each one ``self.propose`` of a Command."""

    # Replicate and apply one command; return its result (the implementer's write path).
    propose: Callable[[commands.Command], Awaitable[ApplyResult]]

    async def put(self, key: str, value: bytes, content_type: str = DEFAULT_CONTENT_TYPE,
                  compares: tuple[Compare, ...] = (), lease: int = 0) -> ApplyResult:
        if not lease:
            return await self.propose(commands.put(key, value, content_type, compares))
        return _lease_checked(await self.propose(commands.Command(
            compares, (Op(OpKind.PUT, key, value, content_type, lease=lease),))))

    async def delete(self, key: str, compares: tuple[Compare, ...] = ()) -> ApplyResult:
        return await self.propose(commands.delete(key, compares))

    async def txn(self, compares: tuple[Compare, ...], success: tuple[Op, ...],
                  failure: tuple[Op, ...] = ()) -> ApplyResult:
        return _lease_checked(await self.propose(commands.Command(compares, success, failure)))


def _lease_checked(result: ApplyResult) -> ApplyResult:
    """The result, or LeaseNotFoundError when a put named a lease that did not exist."""
    missing = lease_not_found(result)
    if missing is not None:
        raise LeaseNotFoundError(missing)
    return result
