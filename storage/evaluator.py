"""The command evaluator: records decoded to compact commands, run against a key -> entry view.

Pure (no database): apply (storage/state_writes.py) runs every call's commands through it,
and the cleaner (storage/cleaner.py) and the replay pipeline run the same functions, so
every replica, the cleaner and the pipeline agree on which branch of a command ran.

- Compares are evaluated against the state before the record: MOD_VERSION is the key's
  mod_version (0 when missing), EXISTS whether it exists, VALUE whether it exists with
  that value. All hold: the success ops run, otherwise the failure ops.
- A PUT keeps the key's create_version, takes its own version for a new key, or restores
  the create_version a cleaned record carries. A DELETE of a missing key changes nothing.
- Records that do not decode are no-ops (their result carries the error), never a crash.
- Leases (docs/leases.md): a PUT with a lease (not a cleaned one) needs the lease's key
  (storage.commands.lease_key) to exist when the branch runs; if one does not, the record
  is a no-op whose error starts with LEASE_NOT_FOUND. Otherwise each lease it attaches
  keys to has its key put again with its own value (after the branch's ops, once per
  lease), so the lease key's mod_version changes whenever a key is attached: the revoke
  command compares it, and so applies only if no key was attached since it was built.
- A DELETE whose content_type is a lease reason (LEASE_DELETE_REASONS) records the reason
  in its history row and result (watch events show it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import msgpack

from raft.types import Batch
from storage.commands import (
    COMMAND_VERSION,
    LEASE_DELETE_REASONS,
    Command,
    CommandDecodeError,
    CompareKind,
    OpKind,
    decode_command,
    lease_key,
)
from storage.state_schema import HISTORY_OP_DELETE, HISTORY_OP_PUT
from storage.state_types import (
    ApplyResult,
    Entry,
    OpResult,
    new_apply_result,
    new_entry,
    new_op_result,
)

logger = logging.getLogger(__name__)

# The state machine's working form of a command: plain tuples, cheaper to build and read
# than the Command dataclasses, with the same content:
#   (((key, compare_kind, target), ...), ((op_kind, key, value, content_type, create_version, lease), ...) x 2)
# (create_version is 0 except in a PUT the cleaner rewrote, see storage/commands.py; lease 0: none)
CompactOp = tuple[int, str, bytes, str, int, int]
LEASE_NOT_FOUND = "lease-not-found: "  # the error of a record that names a missing lease
CompactCommand = tuple[tuple[tuple[str, int, Any], ...], tuple[CompactOp, ...], tuple[CompactOp, ...]]
_OP_KINDS = {int(kind): kind for kind in OpKind}
_PUT, _DELETE, _GET = int(OpKind.PUT), int(OpKind.DELETE), int(OpKind.GET)
_VALUE = int(CompareKind.VALUE)
_SIMPLE_OP_KINDS = frozenset(_OP_KINDS)


def decode_compact(record: bytes) -> CompactCommand:
    """Decode a record as ``storage.commands.decode_command`` does, into the compact form.

    The common record, one op and no compares, is recognised directly; any other shape goes
    through ``decode_command``, which accepts a superset of what the shortcut accepts and
    gives the same content for it, so both paths agree on every record.
    """
    op = _single_op(record)
    if op is not None:
        return (), ((op[0], op[1], op[2], op[3], 0, 0),), ()
    return compact_command(decode_command(record))


def _single_op(record: bytes) -> list[Any] | None:
    """The op of a record with one plain op and no compares or failure ops, else None
    (also for bytes that are not msgpack: decode_command reports those)."""
    try:
        value = msgpack.unpackb(record, raw=False)
    except Exception:
        return None
    if (type(value) is list and len(value) == 4 and type(value[0]) is int
            and value[0] == COMMAND_VERSION and type(value[1]) is list and not value[1]
            and type(value[2]) is list and len(value[2]) == 1 and type(value[3]) is list
            and not value[3]):
        op = value[2][0]
        if (type(op) is list and len(op) == 4 and type(op[0]) is int and op[0] in _SIMPLE_OP_KINDS
                and type(op[1]) is str and type(op[2]) is bytes and type(op[3]) is str):
            return op
    return None


def compact_command(command: Command) -> CompactCommand:
    return (
        tuple((c.key, int(c.kind), c.target) for c in command.compare),
        tuple((int(o.kind), o.key, o.value, o.content_type, o.create_version, o.lease) for o in command.success),
        tuple((int(o.kind), o.key, o.value, o.content_type, o.create_version, o.lease) for o in command.failure),
    )


# A plain PUT record as the all-puts path carries it: (offset, key, value, content_type).
PutRecord = tuple[int, str, bytes, str]


def decode_call(plan: list[tuple[Batch, int]]
                 ) -> tuple[list[PutRecord], list[tuple[int, CompactCommand | str]] | None]:
    """Decode the records ``plan`` covers (control batches have none).

    While every record is a plain PUT (one put op, no compares, no failure ops, no
    create_version: exactly the records decode_compact returns as one PUT op) they are
    kept as PutRecords and ``(puts, None)`` is returned. At the first other record the
    PUTs so far become compact commands and the rest is decoded as decode_compact does:
    ``(puts, commands)``, commands holding every record (or its decode error) in order.
    """
    puts: list[PutRecord] = []
    append = puts.append
    single_op = _single_op
    for position, (batch, first_index) in enumerate(plan):
        if batch.control:
            continue
        records = batch.records
        base_offset = batch.base_offset
        for index in range(first_index, len(records)):
            op = single_op(records[index])
            if op is not None and op[0] == _PUT:
                append((base_offset + index, op[1], op[2], op[3]))
                continue
            commands: list[tuple[int, CompactCommand | str]] = [
                (offset, ((), ((_PUT, key, value, content_type, 0, 0),), ()))
                for offset, key, value, content_type in puts]
            _decode_rest(plan, position, index, commands)
            return puts, commands
    return puts, None


def _decode_rest(plan: list[tuple[Batch, int]], position: int, index: int,
                 commands: list[tuple[int, CompactCommand | str]]) -> None:
    """Append (offset, command or decode error) to ``commands`` for every record from
    record ``index`` of ``plan[position]`` on."""
    for batch, first_index in plan[position:]:
        if batch.control:
            continue
        for record_index in range(max(first_index, index), len(batch.records)):
            offset = batch.base_offset + record_index
            try:
                commands.append((offset, decode_compact(batch.records[record_index])))
            except CommandDecodeError as exc:
                logger.warning("record at offset %d does not decode (%s); applied as a no-op",
                               offset, exc)
                commands.append((offset, f"record does not decode: {exc}"))
        index = 0


def keys_of(commands: list[tuple[int, CompactCommand | str]]) -> tuple[set[str], set[str]]:
    """(every key the commands may read or write, the keys whose value they may read: a GET's,
    a VALUE compare's). The common one-op command is taken directly."""
    keys: set[str] = set()
    value_keys: set[str] = set()
    add = keys.add
    for _offset, command in commands:
        if type(command) is str:
            continue
        compares, success, failure = command
        if not compares and not failure and len(success) == 1 and not _attaches(success[0]):
            add(success[0][1])
            if success[0][0] == _GET:
                value_keys.add(success[0][1])
        else:
            keys.update(command_keys(command))
            value_keys.update(compare[0] for compare in compares if compare[1] == _VALUE)
            value_keys.update(op[1] for op in (*success, *failure) if op[0] == _GET)
            value_keys.update(lease_key(op[5]) for op in (*success, *failure) if _attaches(op))
    return keys, value_keys


def _attaches(op: CompactOp) -> bool:
    """A client's PUT with a lease (a cleaned PUT, carrying its create_version, is
    unconditional: its lease's key may stand at a later offset of a cleaned log)."""
    return op[0] == _PUT and op[5] != 0 and op[4] == 0


def command_keys(command: CompactCommand) -> Iterator[str]:
    compares, success, failure = command
    for compare in compares:
        yield compare[0]
    for op in (*success, *failure):
        yield op[1]
        if _attaches(op):
            yield lease_key(op[5])


def compare_holds(kind: int, target: int | bool | bytes, entry: Entry | None) -> bool:
    if kind == CompareKind.MOD_VERSION:
        return (0 if entry is None else entry.mod_version) == target
    if kind == CompareKind.EXISTS:
        return (entry is not None) == target
    return entry is not None and entry.value == target


# A change as the evaluator reports it: (version, seq, key, op, value, content_type,
# create_version, lease); apply links it to the key's previous change before writing it.
# A delete's content_type is its lease reason (None: an ordinary delete); lease None: none.
HistoryRow = tuple[int, int, str, int, bytes | None, str | None, int, int | None]


def evaluate_commands(
    commands: Sequence[tuple[int, Command | str]], state: dict[str, Entry | None]
) -> list[ApplyResult]:
    """The apply evaluator on its own: run ``(offset, command or decode error)`` pairs against
    ``state`` (key -> Entry or None, holding every key the commands name; updated in place)
    exactly as apply does, without touching a database. Used by the replay pipeline and
    the simulator's key-value model."""
    return evaluate_compact(
        [(offset, command if isinstance(command, str) else compact_command(command))
         for offset, command in commands], state)[0]


def evaluate_compact(
    commands: Sequence[tuple[int, CompactCommand | str]], state: dict[str, Entry | None]
) -> tuple[list[ApplyResult], list[HistoryRow]]:
    """Run the commands against ``state`` (updated in place); pure and deterministic.

    Returns the results and the history rows (every change, in (version, seq) order).
    """
    results: list[ApplyResult] = []
    history_rows: list[HistoryRow] = []
    append_result = results.append
    append_history = history_rows.append
    for offset, command in commands:
        version = offset + 1
        seq = 0  # position of a change within its record: the same on every replica
        if isinstance(command, str):
            append_result(new_apply_result(offset, version, False, (), (), command))
            continue
        compares, success, failure = command
        if not compares and len(success) == 1 and success[0][0] == _PUT and not _attaches(success[0]):
            # The common record, one unconditional PUT: the loop below without its branches.
            _kind, key, value, content_type, op_create_version, lease = success[0]
            previous = state[key]
            create_version = op_create_version or (
                version if previous is None else previous.create_version)
            entry = new_entry(key, value, content_type, version, create_version, lease)
            state[key] = entry
            append_history((version, 0, key, HISTORY_OP_PUT, value, content_type, create_version, lease or None))
            append_result(new_apply_result(
                offset, version, True, (new_op_result(OpKind.PUT, key, previous is None, False, entry),), ()))
            continue
        failed: tuple[tuple[str, int], ...] = ()
        if compares:
            failed = tuple(
                (key, 0 if state[key] is None else state[key].mod_version)  # type: ignore[union-attr]
                for key, kind, target in compares if not compare_holds(kind, target, state[key]))
        ops = failure if failed else success
        leases = [op[5] for op in ops if _attaches(op)]
        missing = next((lease for lease in leases if state[lease_key(lease)] is None), None)
        if missing is not None:
            append_result(new_apply_result(offset, version, False, (), failed, f"{LEASE_NOT_FOUND}{missing}"))
            continue
        op_results: list[OpResult] = []
        for kind, key, value, content_type, op_create_version, lease in ops:
            previous = state[key]
            if kind == _PUT:
                # A cleaned record restores the create_version of the records it replaced.
                create_version = op_create_version or (
                    version if previous is None else previous.create_version)
                entry = new_entry(key, value, content_type, version, create_version, lease)
                state[key] = entry
                append_history((version, seq, key, HISTORY_OP_PUT, value, content_type, create_version,
                                lease or None))
                seq += 1
                op_results.append(new_op_result(_OP_KINDS[kind], key, previous is None, False, entry))
            elif kind == _DELETE:
                reason = content_type if content_type in LEASE_DELETE_REASONS else None
                if previous is not None:
                    state[key] = None
                    append_history((version, seq, key, HISTORY_OP_DELETE, None, reason,
                                    previous.create_version, None))
                    seq += 1
                op_results.append(new_op_result(_OP_KINDS[kind], key, False, previous is not None, None, reason))
            else:
                op_results.append(new_op_result(_OP_KINDS[kind], key, False, False, previous))
        for lease in dict.fromkeys(leases):  # the attach bump, once per lease (module docstring)
            key = lease_key(lease)
            held: Entry = state[key]  # type: ignore[assignment]
            entry = new_entry(key, held.value, held.content_type, version, held.create_version)
            state[key] = entry
            append_history((version, seq, key, HISTORY_OP_PUT, held.value, held.content_type,
                            held.create_version, None))
            seq += 1
            op_results.append(new_op_result(OpKind.PUT, key, False, False, entry))
        append_result(new_apply_result(offset, version, not failed, tuple(op_results), failed))
    return results, history_rows

