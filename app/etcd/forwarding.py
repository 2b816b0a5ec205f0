"""What a follower's calls to the leader carry on behalf of an authenticated etcd caller
(app/etcd/access.py sets it, app/etcd/leader_link.py reads it): the caller's secret, so the
leader checks its rules again, and a prefix it may read, which a linearizable read's barrier
lists. A context variable: set per call (each gRPC call and gateway request is its own task)."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Forwarding:
    secret: str | None = None  # None: auth off (or a caller known by its certificate only)
    read_prefix: str = ""


NO_FORWARDING = Forwarding()
_current: contextvars.ContextVar[Forwarding | None] = contextvars.ContextVar("etcd_forwarding", default=None)


def forwarding() -> Forwarding:
    return _current.get() or NO_FORWARDING


def set_forwarding(value: Forwarding) -> None:
    _current.set(value)
