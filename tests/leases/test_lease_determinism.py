"""Leases are deterministic state: replicas applying the same records reach identical rows and
delete the same keys at the same version, whether they apply the raw log in one call or
batch by batch, a cleaned log, or a snapshot and the rest (docs/leases.md)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.leases import lease_not_found, revoke_command
from raft.types import Batch
from storage.cleaner import clean_prefix
from storage.commands import (
    LEASE_EXPIRED,
    LEASE_REVOKED,
    Command,
    Compare,
    CompareKind,
    Op,
    OpKind,
    lease_key,
)
from storage.snapshot_store import SnapshotStore
from storage.state_leases import encode_ttl
from storage.state_machine import StateMachine
from tests.state_machine.helpers import data_batch, dump_tables

KEYS = ["a", "b", "c"]
LEASES = [1, 2]
# make test runs a dozen logs (about a second each: five replicas); make test-leases-soak more.
EXAMPLES = int(os.environ.get("LEASE_DETERMINISM_EXAMPLES", "12"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def grant(lease_id: int, ttl_s: int = 60) -> Command:
    key = lease_key(lease_id)
    return Command((Compare(key, CompareKind.EXISTS, False),), (Op(OpKind.PUT, key, encode_ttl(ttl_s)),))


def leased_put(key: str, lease_id: int, value: bytes = b"v") -> Command:
    return Command((), (Op(OpKind.PUT, key, value, lease=lease_id),))


@st.composite
def lease_logs(draw: st.DrawFn) -> list[Batch]:
    """A log from offset 0 of grants, puts with and without leases, deletes, txns and
    revoke/expiry commands built from the state as the leader would, some of them stale
    (other records applied between the read and the revoke: the race the compares guard)."""
    with tempfile.TemporaryDirectory() as directory, StateMachine(str(Path(directory) / "scratch.db")) as scratch:
        batches: list[Batch] = []
        stale: list[Command] = []
        offset = 0
        for _batch in range(draw(st.integers(1, 8))):
            commands: list[Command] = []
            for _record in range(draw(st.integers(1, 4))):
                action = draw(st.sampled_from(["grant", "leased", "put", "delete", "txn", "read", "revoke"]))
                lease_id, key = draw(st.sampled_from(LEASES)), draw(st.sampled_from(KEYS))
                if action == "grant":
                    command = grant(lease_id, draw(st.integers(1, 9)))
                elif action == "leased":
                    command = leased_put(key, lease_id, draw(st.binary(max_size=2)))
                elif action == "put":
                    command = Command((), (Op(OpKind.PUT, key, b"p"),))
                elif action == "delete":
                    command = Command((), (Op(OpKind.DELETE, key),))
                elif action == "txn":
                    branch = (Op(OpKind.PUT, key, b"t", lease=lease_id), Op(OpKind.GET, draw(st.sampled_from(KEYS))))
                    command = Command((Compare(key, CompareKind.EXISTS, draw(st.booleans())),), branch, branch[:1])
                elif action == "read" or not stale:  # the leader reads a lease now, revokes later
                    lease = scratch.lease(lease_id)
                    if lease is None:
                        continue
                    stale.append(revoke_command(lease, draw(st.sampled_from([LEASE_EXPIRED, LEASE_REVOKED]))))
                    continue
                else:
                    command = stale.pop(draw(st.integers(0, len(stale) - 1)))
                commands.append(command)
                scratch.apply([data_batch(offset + len(commands) - 1, [command])])
            if commands:
                batches.append(data_batch(offset, commands))
                offset += len(commands)
        if not batches:
            batches.append(data_batch(0, [grant(1)]))
        return batches


def _replica(directory: Path, name: str, batches: list[Batch], *, one_call: bool = True) -> StateMachine:
    machine = StateMachine(str(directory / f"{name}.db"))
    if one_call:
        machine.apply(batches)
    else:
        for batch in batches:
            machine.apply([batch])
    return machine


def _state(machine: StateMachine) -> tuple[object, ...]:
    """What a replica serves: every entry with its lease (the internal keys too) and each
    lease with its attached keys."""
    _version, entries, _next = machine.list("", limit=1000)
    return (machine.applied_version,
            [(e.key, e.value, e.content_type, e.mod_version, e.create_version, e.lease) for e in entries],
            [machine.lease(lease_id) for lease_id in LEASES])


def _deletes(machine: StateMachine) -> list[tuple[str, int, str | None]]:
    return [(event.key, event.mod_version, event.reason)
            for event in machine.changes("", 0, limit=10_000)[1] if event.type == "delete"]


@SETTINGS
@given(lease_logs(), st.data())
def test_replicas_reach_identical_rows_and_delete_the_same_keys_at_the_same_version(
        batches: list[Batch], data: st.DataObject) -> None:
    end = batches[-1].next_offset
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        one_call = _replica(directory, "one", batches)
        per_batch = _replica(directory, "per-batch", batches, one_call=False)
        # A snapshot taken at a batch boundary, loaded by a fresh replica, then the rest.
        middle = data.draw(st.sampled_from([b.next_offset for b in batches]))
        source = _replica(directory, "source", [b for b in batches if b.next_offset <= middle])
        store = SnapshotStore(str(directory / "snapshots"))
        installed = StateMachine(str(directory / "installed.db"))
        if source.applied_version:
            installed.load_snapshot(str(store.path_for(source.create_snapshot(store))))
        installed.apply([b for b in batches if b.next_offset > middle])
        # A cleaned log (some tombstones dropped) replayed from 0.
        dirty = data.draw(st.integers(0, end))
        cleaning = clean_prefix(batches, dirty, data.draw(st.integers(0, dirty)))
        cleaned = _replica(directory, "cleaned", cleaning.batches + [b for b in batches if b.next_offset > cleaning.clean_end])
        try:
            for machine in (one_call, per_batch, installed, source):
                machine.close()  # key_heads complete: the files compare table by table
            tables = dump_tables(one_call.db_path)
            assert dump_tables(per_batch.db_path) == tables
            assert dump_tables(installed.db_path) == tables
            with StateMachine(one_call.db_path) as reopened:
                expected = _state(reopened)
                with StateMachine(per_batch.db_path) as other:
                    assert _deletes(reopened) == _deletes(other)
            assert _state(cleaned) == expected
        finally:
            cleaned.close()


def test_a_revoke_racing_an_attach_fails_and_the_rebuilt_one_deletes_every_key(tmp_path: Path) -> None:
    replicas = [StateMachine(str(tmp_path / f"{index}.db")) for index in range(2)]
    offset = 0

    def apply(*commands: Command) -> list[object]:
        nonlocal offset
        results = [replica.apply([data_batch(offset, list(commands))]) for replica in replicas]
        offset += len(commands)
        assert results[0] == results[1]
        return list(results[0])

    apply(grant(7), leased_put("x", 7))
    stale = revoke_command(replicas[0].lease(7), LEASE_EXPIRED)  # type: ignore[arg-type]
    apply(leased_put("y", 7))  # attached after the leader read the lease
    [failed] = apply(stale)
    assert not failed.succeeded and replicas[0].get("x")[1] is not None  # type: ignore[attr-defined]
    assert replicas[0].lease(7).keys == (("x", 2), ("y", 3))  # type: ignore[union-attr]
    [revoked] = apply(revoke_command(replicas[0].lease(7), LEASE_EXPIRED))  # type: ignore[arg-type]
    assert revoked.succeeded  # type: ignore[attr-defined]
    for replica in replicas:
        assert replica.lease(7) is None and replica.get("x")[1] is None and replica.get("y")[1] is None
        assert [(e.key, e.mod_version, e.reason) for e in replica.changes("", 4)[1]] == [
            (lease_key(7), 5, "lease-expired"), ("x", 5, "lease-expired"), ("y", 5, "lease-expired")]
    # A put naming the lease now changes nothing, on every replica.
    [refused] = apply(leased_put("z", 7))
    assert lease_not_found(refused) == 7  # type: ignore[arg-type]
    assert all(replica.get("z")[1] is None for replica in replicas)
    for replica in replicas:
        replica.close()
