"""Leases on the client side: the ``/v1/leases`` requests and answers, one lease as its
holder sees it (``LeaseCore``), and the keep-alive schedule both clients follow.

A client keeps all of its leases alive together: every ``ttl/3`` the leases due go in one
``POST /v1/leases/keepalive`` batch to the leader (followed across failovers like any
call). A lease ends for its holder when the cluster answers that it does not know it
(revoked, expired) or when no keep-alive was acknowledged for a whole TTL since the last
acknowledged one was sent: past that point the cluster may have expired it, so the holder
must stop acting on it. The sync client runs the schedule in a thread, the async client in
a task; both drive ``KeepAliveSchedule.round_plan``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from metakv.errors import InvalidRequest, LeaseLost, MetakvError
from metakv.protocol import Answer, Request, parses_answer, with_query

LEASES_PATH = "/v1/leases"
KEEPALIVE_BATCH_MAX = 10_000  # the batch endpoint's bound
KEEPALIVE_FRACTION = 3  # keep-alive every ttl/3, as etcd's client does
MIN_KEEPALIVE_DEADLINE_S = 0.5  # a keep-alive round gives up no sooner, unless a lease's deadline is closer
LAST_KEEPALIVE_S = 0.05  # the shortest try, for a lease about to reach its deadline
IDLE_WAKE_S = 5.0  # the keeper's longest sleep with no lease due

LostCallback = Callable[["LeaseCore"], None]
log = logging.getLogger("metakv.client")


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    """``GET /v1/leases/{id}``: the TTL, the time left (leader's clock), the attached keys."""

    id: int
    ttl_s: int
    remaining_s: float
    granted_version: int
    keys: list[str] | None = None  # asked for with keys=True


@dataclass(frozen=True, slots=True)
class LeaseSummary:
    id: int
    ttl_s: int


# ---------------------------------------------------------------------------- requests


def _json_request(method: str, path: str, body: dict[str, Any], **options: Any) -> Request:
    return Request(method, path, {"Content-Type": "application/json"}, json.dumps(body).encode(), **options)


def check_ttl(ttl_s: int) -> int:
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s <= 0:
        raise InvalidRequest("Invalid TTL", f"a lease's ttl_s is a whole number of seconds >= 1, not {ttl_s!r}")
    return ttl_s


def lease_id_of(lease: int | LeaseCore) -> int:
    """The id of a lease given as a ``Lease`` or as its number; a lost ``Lease`` raises ``LeaseLost``."""
    if isinstance(lease, LeaseCore):
        lease.check()
        return lease.id
    if isinstance(lease, bool) or not isinstance(lease, int) or lease <= 0:
        raise InvalidRequest("Invalid lease", f"a lease id is an integer >= 1, not {lease!r}")
    return lease


def grant_request(ttl_s: int, lease_id: int | None) -> Request:
    body: dict[str, Any] = {"ttl_s": check_ttl(ttl_s)}
    if lease_id is not None:
        body["id"] = lease_id_of(lease_id)
    # A grant re-sent after an unknown outcome could leave a second lease nobody keeps alive.
    return _json_request("POST", LEASES_PATH, body, target_leader=True, writes=True, safe_to_resend=False,
                         ok_statuses=frozenset({201}))


def revoke_request(lease_id: int) -> Request:
    # Safe to re-send: a second revoke of the same lease answers 404, which counts as done.
    return Request("DELETE", f"{LEASES_PATH}/{lease_id}", target_leader=True, writes=True,
                   ok_statuses=frozenset({200, 404}))


def info_request(lease_id: int, keys: bool) -> Request:
    return Request("GET", with_query(f"{LEASES_PATH}/{lease_id}", {"keys": keys or None}), target_leader=True)


def list_request() -> Request:
    return Request("GET", LEASES_PATH)


def keepalive_one_request(lease_id: int) -> Request:
    return Request("POST", f"{LEASES_PATH}/{lease_id}/keepalive", target_leader=True)


def keepalive_request(lease_ids: list[int], deadline_s: float) -> Request:
    """One batch; given up after ``deadline_s`` (the schedule then re-plans, not the call)."""
    return _json_request("POST", f"{LEASES_PATH}/keepalive", {"ids": lease_ids}, target_leader=True,
                         timeout_s=deadline_s, deadline_s=deadline_s)


@parses_answer
def parse_grant(answer: Answer) -> tuple[int, int, int]:
    """``(id, ttl_s, version)`` of a granted lease."""
    body = answer.json()
    return int(body["id"]), int(body["ttl_s"]), int(body["version"])


@parses_answer
def parse_ttl(answer: Answer) -> int:
    return int(answer.json()["ttl_s"])


@parses_answer
def parse_revoke(answer: Answer) -> int | None:
    """The number of keys the revoke deleted; None when the lease was already gone."""
    if answer.status == 404:
        return None
    return int(answer.json()["deleted_keys"])


@parses_answer
def parse_info(answer: Answer) -> LeaseInfo:
    body = answer.json()
    keys = body.get("keys")
    return LeaseInfo(int(body["id"]), int(body["ttl_s"]), float(body["remaining_s"]), int(body["granted_version"]),
                     [str(key) for key in keys] if keys is not None else None)


@parses_answer
def parse_list(answer: Answer) -> list[LeaseSummary]:
    return [LeaseSummary(int(item["id"]), int(item["ttl_s"])) for item in answer.json()["leases"]]


@parses_answer
def parse_keepalive(answer: Answer) -> tuple[dict[int, int], set[int]]:
    """``({id: ttl_s} kept alive, {ids} the cluster does not know})``."""
    body = answer.json()
    return ({int(item["id"]): int(item["ttl_s"]) for item in body["leases"]},
            {int(lease_id) for lease_id in body["not_found"]})


# ---------------------------------------------------------------------------- one lease


class LeaseCore:
    """A granted lease as its holder sees it. ``alive`` until the cluster reports it gone or
    no keep-alive was acknowledged for a TTL; then it ends for good, once: ``lost_reason``
    says why, the callbacks given to ``on_lost`` run (in the keeper's thread or task), and
    every later use (``check``, a put with it, a lock on it) raises ``LeaseLost``."""

    def __init__(self, lease_id: int, ttl_s: int, granted_version: int, sent_at: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.id = lease_id
        self.ttl_s = ttl_s
        self.granted_version = granted_version
        self._clock = clock
        self.acked_sent_at = sent_at  # when the last acknowledged grant or keep-alive was sent
        self.lost_reason: str | None = None
        self._callbacks: list[LostCallback] = []
        self._guard = threading.Lock()

    def __repr__(self) -> str:
        state = "alive" if self.alive else f"lost: {self.lost_reason}"
        return f"<{type(self).__name__} {self.id} ttl={self.ttl_s}s {state}>"

    @property
    def deadline(self) -> float:
        """The holder's own deadline (monotonic clock): past it the lease may have expired."""
        return self.acked_sent_at + self.ttl_s

    @property
    def alive(self) -> bool:
        return self.lost_reason is None and self._clock() < self.deadline

    def check(self) -> None:
        """Raise ``LeaseLost`` if the lease ended (or its holder's deadline passed)."""
        if self.lost_reason is None and self._clock() >= self.deadline:
            self.end("no keep-alive was acknowledged for a whole TTL")
        if self.lost_reason is not None:
            raise LeaseLost("Lease lost", f"lease {self.id}: {self.lost_reason}", lease_id=self.id)

    def on_lost(self, callback: LostCallback) -> None:
        """Call ``callback(lease)`` when the lease ends (at once if it already has)."""
        with self._guard:
            if self.lost_reason is None:
                self._callbacks.append(callback)
                return
        callback(self)

    def acknowledged(self, ttl_s: int, sent_at: float) -> None:
        """A keep-alive sent at ``sent_at`` was acknowledged. One answered after the holder's
        deadline does not bring the lease back: it ended there (``alive`` said so)."""
        if self.lost_reason is None and self._clock() >= self.deadline:
            self.end("no keep-alive was acknowledged for a whole TTL")
        if self.lost_reason is None:
            self.ttl_s = ttl_s
            self.acked_sent_at = max(self.acked_sent_at, sent_at)

    def end(self, reason: str) -> None:
        """End the lease for its holder (the first reason wins) and tell its users."""
        with self._guard:
            if self.lost_reason is not None:
                return
            self.lost_reason = reason
            callbacks, self._callbacks = self._callbacks, []
        self.notify_lost()
        for callback in callbacks:
            try:
                callback(self)
            except Exception:  # the keeper runs it: its error must not end the other leases' keep-alives
                log.exception("lease %d: an on_lost callback failed", self.id)

    def notify_lost(self) -> None:
        """Set the flavour's event (``Lease.done``, ``AsyncLease.done``)."""


class KeepAliveSchedule:
    """The leases one client keeps alive, and when. Each lease is due ``ttl/3`` after its
    last acknowledged keep-alive was sent; a round sends every due lease in batches."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._leases: dict[int, LeaseCore] = {}
        self._clock = clock
        self._guard = threading.Lock()

    def add(self, lease: LeaseCore) -> None:
        with self._guard:
            self._leases[lease.id] = lease

    def remove(self, lease_id: int) -> None:
        with self._guard:
            self._leases.pop(lease_id, None)

    def end_all(self, reason: str) -> None:
        with self._guard:
            leases, self._leases = list(self._leases.values()), {}
        for lease in leases:
            lease.end(reason)

    def __len__(self) -> int:
        return len(self._leases)

    def _live(self) -> list[LeaseCore]:
        with self._guard:
            return [lease for lease in self._leases.values() if lease.lost_reason is None]

    @staticmethod
    def due_at(lease: LeaseCore) -> float:
        return lease.acked_sent_at + lease.ttl_s / KEEPALIVE_FRACTION

    def wait_s(self) -> float:
        """How long the keeper may sleep before the next round."""
        leases = self._live()
        if not leases:
            return IDLE_WAKE_S
        return max(0.0, min(min(self.due_at(lease) for lease in leases) - self._clock(), IDLE_WAKE_S))

    def round_plan(self) -> Generator[Request, Answer, None]:
        """Keep every due lease alive (in batches of at most ``KEEPALIVE_BATCH_MAX``); end
        those the cluster no longer knows and those past their deadline."""
        # Leases due within half an interval go now too: the batches stay few and full.
        now = self._clock()
        due = sorted((lease for lease in self._live()
                      if self.due_at(lease) - lease.ttl_s / (2 * KEEPALIVE_FRACTION) <= now), key=lambda lease: lease.id)
        for start in range(0, len(due), KEEPALIVE_BATCH_MAX):
            batch = {lease.id: lease for lease in due[start:start + KEEPALIVE_BATCH_MAX]}
            shortest_ttl_s = min(lease.ttl_s for lease in batch.values())
            sent_at = self._clock()
            # Never past a lease's deadline: its end (done, on_lost) must not wait for this call.
            remaining_s = min(lease.deadline for lease in batch.values()) - sent_at
            deadline_s = max(LAST_KEEPALIVE_S, min(max(MIN_KEEPALIVE_DEADLINE_S, shortest_ttl_s / KEEPALIVE_FRACTION),
                                                   remaining_s))
            try:
                kept, not_found = parse_keepalive((yield keepalive_request(list(batch), deadline_s)))
            except MetakvError:  # no leader for now, or a malformed answer: the next round tries
                continue  # again, until the deadlines
            for lease_id, ttl_s in kept.items():
                if lease_id in batch:
                    batch[lease_id].acknowledged(ttl_s, sent_at)
            for lease_id in not_found:
                if lease_id in batch:
                    batch[lease_id].end("the cluster reports it not found (expired or revoked)")
                    self.remove(lease_id)
        for lease in self._live():
            if self._clock() >= lease.deadline:
                lease.end("no keep-alive was acknowledged for a whole TTL")
                self.remove(lease.id)
