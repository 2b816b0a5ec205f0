"""The lease reads: the leases in the state and the keys attached to one (docs/leases.md).

A lease is the internal key ``storage.commands.lease_key(id)``: its value the TTL in
seconds (ASCII digits), its create_version the version that granted it. A key is attached
to a lease when its newest change is a put whose history row names the lease; the partial
index on ``history.lease`` finds those rows without a scan, and the key index says which
of them are still their key's head.
"""

from __future__ import annotations

from dataclasses import dataclass

from storage.commands import LEASE_KEY_PREFIX, lease_key
from storage.state_reads import MAX_LIST_LIMIT, StateReads


@dataclass(frozen=True, slots=True)
class LeaseState:
    """One lease at ``version``: ``mod_version`` is its key's (it changes whenever a key is
    attached), ``keys`` each attached key with its mod_version, in key order."""

    id: int
    ttl_s: int
    granted_version: int
    mod_version: int
    version: int
    keys: tuple[tuple[str, int], ...]


def encode_ttl(ttl_s: int) -> bytes:
    return str(ttl_s).encode("ascii")


def lease_id_of(key: str) -> int:
    return int(key[len(LEASE_KEY_PREFIX):])


class StateLeases(StateReads):
    """Reads of the leases; writes are ordinary commands (app/leases.py builds them)."""

    def _prepare_statements(self) -> None:
        super()._prepare_statements()
        # Every retained put that attached a key to the lease (the history_lease index).
        self._sql_lease_rows = "SELECT key, version, seq FROM history WHERE lease = ?"

    def lease(self, lease_id: int) -> LeaseState | None:
        """The lease and its attached keys at the applied version (None: no such lease).
        Taken holding the publish lock, so the keys are exactly those attached at that
        version: rows a call committed but has not published yet are not heads yet."""
        cursor = self._reader_cursor()
        with self._publish_lock:
            version = self._applied_version
            index_get = self._index.get
            head = index_get(lease_key(lease_id))
            if head is None or not head[0]:
                return None
            row = cursor.execute(self._sql_row, head[1:]).fetchone()
            keys = sorted((key, row_version) for key, row_version, seq in
                          cursor.execute(self._sql_lease_rows, (lease_id,))
                          if (index_get(key) or (0, 0, 0))[1:] == (row_version, seq))
        return LeaseState(lease_id, int(row[0]), head[0], head[1], version, tuple(keys))

    def lease_count(self) -> int:
        """How many leases the applied state holds (the index alone: no row read)."""
        with self._publish_lock:
            return sum(1 for _key, head in self._index.range(LEASE_KEY_PREFIX, None) if head[0])

    def leases(self) -> tuple[int, list[tuple[int, int, int]]]:
        """(applied version, every lease as (id, ttl_s, granted_version), by id)."""
        found: list[tuple[int, int, int]] = []
        after: str | None = None
        version: int | None = None
        while True:
            version_now, entries, after = self.list(LEASE_KEY_PREFIX, after=after, limit=MAX_LIST_LIMIT,
                                                    at_version=version)
            version = version_now
            found.extend((lease_id_of(entry.key), int(entry.value), entry.create_version) for entry in entries)
            if after is None:
                return version, found
