"""Checks a recorded chaos history: per-key linearizability plus the weaker guarantees.

Why per key: a register per key is independent of the others as long as every operation
touches one key (the workload keeps transactions to one key), and checking keys apart keeps
the search small (P-compositionality).

Linearizability (Wing & Gong's search with Lowe's just-in-time linearization): an operation
may be linearized next only if it was invoked before every still-unlinearized operation
completed. The search is a depth-first walk over configurations (set of linearized
operations, register state); a configuration already explored is not explored again.
An **indeterminate** operation (invoked, outcome unknown: 504 indeterminate or a transport
error after sending) has no completion time: it may be linearized at any point after its
invocation, or never (it did not take effect). Because taking effect is optional, a
configuration that differs from an explored one only by having linearized *more*
indeterminate operations is dominated by it and is pruned; determinate operations are tried
before indeterminate ones so that the dominating configurations are explored first.

The register state carries the key's ``mod_version`` (the log version its last write
produced) and a version floor (the newest known write version linearized so far): ok
writes must be linearized in version order, reads must see the version the last write
produced, and CAS on ``mod_version`` compares against it. A write that took effect with an
unknown version leaves the version unknown until a read or a successful CAS reveals it.

Other checks (``check_history``):
- reads at any consistency: never from the future (the value was written by an operation
  invoked before the read completed, and its version is not above the version the node
  claimed), a consistent snapshot (no acknowledged write on the key between the value's
  version and the node's version), and for one process on one node incarnation the node's
  version never goes backwards;
- reads with ``min_version``: answered at a version at least ``min_version``;
- watch streams: strictly increasing versions, every event matches a write, and every
  acknowledged write inside a watched range is delivered;
- final reads after the heal: every node reports the same state, and no acknowledged write
  is lost (the final state is at least as new as the newest acknowledged write).
"""

from __future__ import annotations

import bisect
import json
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# A register state: (present, value, mod_version or None when unknown, version floor).
State = tuple[bool, str | None, int | None, int]
INITIAL_STATE: State = (False, None, None, 0)

# The value an indeterminate write is given when no operation ever observed its value.
UNREAD_VALUE = "<a value nobody read>"
# Bound on the configurations explored per key before giving up with "unknown".
MAX_CONFIGURATIONS_PER_KEY = 1_000_000
# How many linearized operations a failure report shows before the stuck point.
REPORT_CONTEXT_OPS = 8


@dataclass(frozen=True, slots=True)
class RegisterOp:
    """One operation on one key, in the checker's terms.

    ``condition``: ("mod_version", V) | ("value", v) | ("exists", bool) | None, evaluated on
    the state before the operation; ``condition_held`` says what the client learned (True for
    an ok conditional write, False for a 412 / failed txn, None when indeterminate).
    ``observation``: what the client saw of the prior state: ("absent",),
    ("present", value, mod_version or None), ("exists", bool) or None.
    ``action``: ("put", value) | ("delete",) | None, applied when the condition held.
    ``version``: the version an ok write produced.
    """

    op_id: int
    process: str
    key: str
    kind: str
    invoke_ns: int
    complete_ns: int | None  # None: indeterminate
    condition: tuple[Any, ...] | None = None
    condition_held: bool | None = None
    observation: tuple[Any, ...] | None = None
    action: tuple[Any, ...] | None = None
    version: int | None = None

    @property
    def indeterminate(self) -> bool:
        return self.complete_ns is None

    def describe(self) -> str:
        """One line for a failure report."""
        parts = [f"#{self.op_id} p{self.process} {self.kind}"]
        if self.condition is not None:
            parts.append(f"if {self.condition[0]}={self.condition[1]!r}")
        if self.action is not None:
            if self.action[0] == "put":
                parts.append(("" if self.kind == "put" else "put ") + repr(self.action[1]))
            elif self.kind != "delete":
                parts.append("delete")
        if self.indeterminate:
            parts.append("-> indeterminate")
        else:
            outcome = []
            if self.condition_held is False:
                outcome.append("condition failed")
            if self.observation is not None:
                outcome.append("saw " + _describe_observation(self.observation))
            if self.version is not None:
                outcome.append(f"version {self.version}")
            parts.append("-> " + (", ".join(outcome) if outcome else "ok"))
        start_ms = self.invoke_ns / 1e6
        end = "?" if self.complete_ns is None else f"{self.complete_ns / 1e6:.3f}"
        parts.append(f"[{start_ms:.3f} .. {end} ms]")
        return " ".join(parts)


def _describe_observation(observation: tuple[Any, ...]) -> str:
    if observation[0] == "absent":
        return "absent"
    if observation[0] == "exists":
        return "present" if observation[1] else "absent"
    version = "?" if observation[2] is None else observation[2]
    return f"{observation[1]!r}@{version}"


def describe_state(state: State) -> str:
    present, value, mod_version, floor = state
    if not present:
        return f"absent (newest write version {floor})"
    version = "unknown" if mod_version is None else str(mod_version)
    return f"{value!r} with mod_version {version}"


# ---------------------------------------------------------------------------------------
# The register model


def _match_observation(state: State, observation: tuple[Any, ...] | None,
                       claimed: frozenset[int]) -> tuple[State | None, str]:
    """Return the (possibly refined) state if the observation fits it, else a reason."""
    if observation is None:
        return state, ""
    present, value, mod_version, floor = state
    if observation[0] == "exists":
        if observation[1] == present:
            return state, ""
        return None, f"saw the key {'present' if observation[1] else 'absent'} but it is {describe_state(state)}"
    if observation[0] == "absent":
        if not present:
            return state, ""
        return None, f"saw absent but the key holds {describe_state(state)}"
    _, seen_value, seen_version = observation
    if not present:
        return None, f"saw {seen_value!r} but the key is {describe_state(state)}"
    if seen_value != value:
        return None, f"saw {seen_value!r} but the key holds {describe_state(state)}"
    if seen_version is None:
        return state, ""
    if mod_version is None:
        if seen_version <= floor:
            return None, f"saw version {seen_version}, not above the newest write version {floor}"
        if seen_version in claimed:
            return None, f"saw version {seen_version}, which another write of the key produced"
        return (present, value, seen_version, seen_version), ""
    if seen_version != mod_version:
        return None, f"saw mod_version {seen_version} but the key holds {describe_state(state)}"
    return state, ""


def _evaluate_condition(state: State, condition: tuple[Any, ...], held: bool,
                        claimed: frozenset[int]) -> tuple[State | None, str]:
    """Return the (possibly refined) state if the condition evaluates to ``held``."""
    present, value, mod_version, floor = state
    kind, expected = condition
    if kind == "exists":
        actual: bool | None = present == expected
    elif kind == "value":
        actual = present and value == expected
    elif kind == "mod_version":
        if not present:
            actual = False
        elif mod_version is None:
            if held:
                if expected <= floor:
                    return None, f"mod_version {expected} is not above the newest write version {floor}"
                if expected in claimed:
                    return None, f"mod_version {expected} was produced by another write of the key"
                return (present, value, expected, expected), ""
            return state, ""  # unknown version: differing from expected is possible
        else:
            actual = mod_version == expected
    else:
        raise ValueError(f"unknown condition {kind!r}")
    if actual == held:
        return state, ""
    verdict = "held" if held else "failed"
    return None, f"condition {kind}={expected!r} {verdict} but the key is {describe_state(state)}"


def step(state: State, op: RegisterOp, claimed: frozenset[int] = frozenset()) -> tuple[State | None, str]:
    """Apply ``op`` to ``state`` as if it took effect now; (None, reason) if it cannot.
    ``claimed``: versions known to belong to acknowledged writes of this key, which a write
    of unknown version therefore cannot have produced."""
    refined, reason = _match_observation(state, op.observation, claimed)
    if refined is None:
        return None, reason
    held = True if op.condition_held is None else op.condition_held
    if op.condition is not None:
        refined, reason = _evaluate_condition(refined, op.condition, held, claimed)
        if refined is None:
            return None, reason
    if op.action is None or not held:
        return refined, ""
    present, _, _, floor = refined
    if op.version is not None and op.version <= floor:
        return None, f"wrote version {op.version}, not above the newest write version {floor}"
    new_floor = floor if op.version is None else op.version
    if op.action[0] == "put":
        return (True, op.action[1], op.version, new_floor), ""
    if not present:
        return refined, ""  # deleting a missing key changes nothing
    return (False, None, None, new_floor), ""


# ---------------------------------------------------------------------------------------
# The search


@dataclass(slots=True)
class KeyResult:
    """The verdict for one key; ``report`` explains a failure."""

    key: str
    ok: bool | None  # None: gave up after MAX_CONFIGURATIONS_PER_KEY
    op_count: int
    configurations: int
    report: str = ""


@dataclass(slots=True)
class _Deepest:
    linearized_count: int = -1
    path: list[int] = field(default_factory=list)
    state: State = INITIAL_STATE
    reasons: list[str] = field(default_factory=list)
    blocking: int | None = None


def _settle_observed(ops: list[RegisterOp]) -> list[RegisterOp]:
    """An indeterminate write whose (unique) value some completed operation observed surely
    took effect before that observer completed: make it determinate with that deadline.
    Equivalent for the search, and it spares the search from guessing where it belongs.
    Repeated to a fixed point, since a settled write may itself have observed a value."""
    settled = list(ops)
    while True:
        seen_by: dict[str, int] = {}
        version_of: dict[str, int] = {}
        for op in settled:
            if op.indeterminate:
                continue
            values = []
            if op.observation is not None and op.observation[0] == "present":
                values.append(op.observation[1])
                if op.observation[2] is not None:
                    version_of[op.observation[1]] = op.observation[2]
            if op.condition is not None and op.condition[0] == "value" and op.condition_held:
                values.append(op.condition[1])
            for value in values:
                complete_ns = int(op.complete_ns or 0)
                seen_by[value] = min(seen_by.get(value, complete_ns), complete_ns)
        changed = False
        for position, op in enumerate(settled):
            if op.indeterminate and op.action is not None and op.action[0] == "put" and op.action[1] in seen_by:
                # the version a reader saw with the value is the version this write produced
                settled[position] = replace(
                    op, complete_ns=max(seen_by[op.action[1]], op.invoke_ns + 1), condition_held=True,
                    kind=op.kind + " (indeterminate, observed)", version=version_of.get(op.action[1]))
                changed = True
        if not changed:
            break
    for position, op in enumerate(settled):
        if op.indeterminate and op.action is not None and op.action[0] == "put":
            # nobody read this value, so which unobserved write set the key is irrelevant:
            # giving them one value lets the memo merge their configurations
            settled[position] = replace(op, action=("put", UNREAD_VALUE), kind=f"{op.kind} {op.action[1]!r} as")
    return settled


def _read_only(op: RegisterOp) -> bool:
    return op.action is None or op.condition_held is False


def check_key(key: str, ops: list[RegisterOp], max_configurations: int = MAX_CONFIGURATIONS_PER_KEY) -> KeyResult:
    """Search for a linearization of ``ops`` (all on ``key``).

    Besides the memo, one reduction keeps the search small: a completed read-only operation
    (a read, a failed condition) that fits the current state is linearized at once with no
    alternative tried, since placing it earlier never constrains what follows.
    """
    ops = _settle_observed(ops)
    determinate = sorted((op for op in ops if not op.indeterminate), key=lambda o: (o.invoke_ns, o.op_id))
    indeterminate = sorted((op for op in ops if op.indeterminate), key=lambda o: (o.invoke_ns, o.op_id))
    det_count = len(determinate)
    det_invoke = [op.invoke_ns for op in determinate]
    det_read_only = [_read_only(op) for op in determinate]
    by_return = sorted(range(det_count), key=lambda i: (determinate[i].complete_ns, i))
    return_rank_of = [0] * det_count
    for rank, index in enumerate(by_return):
        return_rank_of[index] = rank
    ind_invoke = [op.invoke_ns for op in indeterminate]
    # an unconditional indeterminate write sets a state that does not depend on the prior one
    ind_blind = [op.condition is None and op.observation is None for op in indeterminate]
    # interchangeable indeterminate ops (same effect, e.g. unread blind puts): trying the
    # earliest pending one of a class is enough, any later one is a candidate whenever it is
    ind_class: list[object] = [(op.condition, op.observation, op.action) for op in indeterminate]
    all_det_mask = (1 << det_count) - 1
    claimed = frozenset(op.version for op in determinate if op.version is not None)

    # memo: (determinate-linearized mask, state) -> indeterminate masks already explored
    explored: dict[tuple[int, State], list[int]] = {}
    deepest = _Deepest()
    configurations = 0

    def lowest_unset(mask: int) -> int:
        return (~mask & (mask + 1)).bit_length() - 1

    def candidates(det_mask: int, ret_mask: int, ind_mask: int, state: State,
                   after_indeterminate: bool) -> list[tuple[bool, int]]:
        rank = lowest_unset(ret_mask)
        limit = determinate[by_return[rank]].complete_ns if rank < det_count else None
        index = lowest_unset(det_mask)
        choices: list[tuple[bool, int]] = []
        while index < det_count and (limit is None or det_invoke[index] < limit):
            if not det_mask >> index & 1:
                if det_read_only[index] and step(state, determinate[index], claimed)[0] is not None:
                    return [(True, index)]
                choices.append((True, index))
            index += 1
        classes_tried: set[object] = set()
        for index in range(len(indeterminate)):
            if limit is not None and ind_invoke[index] >= limit:
                break
            if ind_mask >> index & 1 or ind_class[index] in classes_tried:
                continue
            classes_tried.add(ind_class[index])
            # right after an indeterminate op, a blind write makes that op pointless: the
            # configuration without it (explored separately) dominates
            if not (after_indeterminate and ind_blind[index]):
                choices.append((False, index))
        return choices

    def dominated(det_mask: int, state: State, ind_mask: int) -> bool:
        seen = explored.setdefault((det_mask, state), [])
        for other in seen:
            if other & ~ind_mask == 0:
                return True
        seen.append(ind_mask)
        return False

    # Each frame: (det_mask, ret_mask, ind_mask, state, remaining choices)
    dominated(0, INITIAL_STATE, 0)
    stack: list[tuple[int, int, int, State, Iterator[tuple[bool, int]]]] = [
        (0, 0, 0, INITIAL_STATE, iter(candidates(0, 0, 0, INITIAL_STATE, False)))
    ]
    path: list[RegisterOp] = []
    failures_here: list[RegisterOp] = []
    while stack:
        det_mask, ret_mask, ind_mask, state, iterator = stack[-1]
        if det_mask == all_det_mask:
            return KeyResult(key, True, len(ops), configurations)
        linearized = det_mask.bit_count()
        advanced = False
        for is_det, index in iterator:
            op = determinate[index] if is_det else indeterminate[index]
            new_state, _ = step(state, op, claimed)
            if new_state is None:
                if linearized >= deepest.linearized_count:
                    failures_here.append(op)
                continue
            if is_det:
                new_det = det_mask | 1 << index
                new_ret = ret_mask | 1 << return_rank_of[index]
                new_ind = ind_mask
            else:
                new_det, new_ret, new_ind = det_mask, ret_mask, ind_mask | 1 << index
            if dominated(new_det, new_state, new_ind):
                continue
            configurations += 1
            if configurations > max_configurations:
                return KeyResult(key, None, len(ops), configurations,
                                 f"key {key!r}: gave up after {max_configurations} configurations")
            stack.append((new_det, new_ret, new_ind, new_state,
                          iter(candidates(new_det, new_ret, new_ind, new_state, not is_det))))
            path.append(op)
            advanced = True
            break
        if advanced:
            failures_here = []
            continue
        # Exhausted this configuration: remember it if it got furthest, then backtrack.
        if linearized > deepest.linearized_count:
            rank = lowest_unset(ret_mask)
            deepest = _Deepest(linearized, [op.describe() for op in path[-REPORT_CONTEXT_OPS:]], state,
                               [f"{op.describe()}: {step(state, op, claimed)[1]}" for op in failures_here], determinate[by_return[rank]].op_id if rank < det_count else None)
        failures_here = []
        stack.pop()
        if path:
            path.pop()
    return KeyResult(key, False, len(ops), configurations, _failure_report(key, ops, deepest))


def _failure_report(key: str, ops: list[RegisterOp], deepest: _Deepest) -> str:
    by_id = {op.op_id: op for op in ops}
    lines = [f"key {key!r}: no linearization of its {len(ops)} operations exists."]
    lines.append(f"The longest valid prefix linearizes {deepest.linearized_count} completed operations, ending:")
    lines.extend(f"    {line}" for line in deepest.path)
    lines.append(f"  leaving the key {describe_state(deepest.state)}.")
    if deepest.blocking is not None:
        blocking = by_id[deepest.blocking]
        lines.append("  This operation completed before any order could place it:")
        lines.append(f"    {blocking.describe()}")
    lines.append("  Every operation that could come next fails:")
    lines.extend(f"    {reason}" for reason in deepest.reasons)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# From history records to register operations

WRITE_OPS = {"put", "cas", "create", "delete", "txn"}


def _record_invoke(record: dict[str, Any]) -> int:
    return int(record["invoke_ns"])


def to_register_op(op_id: int, record: dict[str, Any]) -> RegisterOp | None:
    """Translate one history record into a RegisterOp; None when it is not checked for
    linearizability (surely-not-happened errors, non-linearizable reads, watches)."""
    kind = record["op"]
    outcome = record["outcome"]
    if outcome == "error" or (kind != "read" and kind not in WRITE_OPS):
        return None
    result = record.get("result") or {}
    indeterminate = outcome == "indeterminate"
    complete_ns = None if indeterminate else int(record["complete_ns"])
    common = dict(op_id=op_id, process=str(record["process"]), key=record["key"], kind=kind,
                  invoke_ns=_record_invoke(record), complete_ns=complete_ns)
    if kind == "read":
        if indeterminate or record.get("consistency") != "linearizable":
            return None
        return RegisterOp(**common, observation=_read_observation(result))
    ok = outcome == "ok"
    version = result.get("version") if ok else None
    if kind == "put":
        observation = ("exists", not result["created"]) if ok and "created" in result else None
        return RegisterOp(**common, action=("put", record["value"]), observation=observation, version=version)
    if kind == "delete":
        observation = ("exists", bool(result["deleted"])) if ok and "deleted" in result else None
        if ok and not result.get("deleted", True):
            version = None
        return RegisterOp(**common, action=("delete",), observation=observation, version=version)
    held = None if indeterminate else ok
    if kind == "cas":
        return RegisterOp(**common, condition=("mod_version", record["expected_version"]),
                          condition_held=held, action=("put", record["value"]), version=version)
    if kind == "create":
        return RegisterOp(**common, condition=("exists", False), condition_held=held,
                          action=("put", record["value"]), version=version)
    # txn on one key: compare (value | mod_version | exists), success put/delete, failure get
    compare = record["compare"]
    action = ("delete",) if record.get("success_op") == "delete" else ("put", record["value"])
    observation = None
    if outcome == "fail" and "read" in result:
        observation = _read_observation(result["read"])
    if ok and action[0] == "delete":
        version = None  # a txn delete may hit a missing key; its version says nothing
    return RegisterOp(**common, condition=(compare[0], compare[1]), condition_held=held,
                      action=action, observation=observation, version=version)


def _read_observation(result: dict[str, Any]) -> tuple[Any, ...]:
    if not result.get("found"):
        return ("absent",)
    return ("present", result["value"], result.get("mod_version"))


# ---------------------------------------------------------------------------------------
# Whole-history checks


@dataclass(slots=True)
class CheckReport:
    """The verdict for a whole history."""

    ok: bool
    keys: list[KeyResult]
    anomalies: list[str]
    op_count: int
    checked_op_count: int
    elapsed_s: float = 0.0

    def summary(self) -> str:
        unknown = [k.key for k in self.keys if k.ok is None]
        bad = [k for k in self.keys if k.ok is False]
        lines = [
            f"{'VALID' if self.ok else 'INVALID'}: {self.op_count} records, {self.checked_op_count} "
            f"register operations on {len(self.keys)} keys checked in {self.elapsed_s:.2f} s",
        ]
        if unknown:
            lines.append(f"search gave up (treated as failure) on keys: {unknown}")
        for key_result in bad:
            lines.append(key_result.report)
        lines.extend(self.anomalies)
        return "\n".join(lines)


def load_history(path: Path) -> list[dict[str, Any]]:
    with path.open() as handle:
        return [json.loads(line) for line in handle if line.strip()]


def check_linearizable(records: list[dict[str, Any]]) -> tuple[list[KeyResult], int]:
    per_key: dict[str, list[RegisterOp]] = defaultdict(list)
    for op_id, record in enumerate(records):
        op = to_register_op(op_id, record)
        if op is not None:
            per_key[op.key].append(op)
    results = [check_key(key, ops) for key, ops in sorted(per_key.items())]
    return results, sum(len(ops) for ops in per_key.values())


def _writes_by_key(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, dict[str, Any]]]]:
    writes: dict[str, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    for op_id, record in enumerate(records):
        if record["op"] in WRITE_OPS and record["outcome"] != "error":
            writes[record["key"]].append((op_id, record))
    return writes


def _ok_write_versions(writes: list[tuple[int, dict[str, Any]]]) -> list[tuple[int, str, int]]:
    """(version, "put"|"delete", op_id) of acknowledged writes that changed the key."""
    changes = []
    for op_id, record in writes:
        if record["outcome"] != "ok":
            continue
        result = record.get("result") or {}
        if record["op"] == "delete" and not result.get("deleted", True):
            continue
        if record["op"] == "txn" and record.get("success_op") == "delete":
            continue  # may have deleted a missing key: not a known change
        if result.get("version") is None:
            continue
        kind = "delete" if record["op"] == "delete" else "put"
        changes.append((int(result["version"]), kind, op_id))
    changes.sort()
    return changes


def _may_delete(writes: list[tuple[int, dict[str, Any]]]) -> bool:
    return any(
        record["outcome"] == "indeterminate"
        and (record["op"] == "delete" or (record["op"] == "txn" and record.get("success_op") == "delete"))
        or (record["op"] == "txn" and record.get("success_op") == "delete" and record["outcome"] == "ok")
        for _, record in writes
    )


def check_reads(records: list[dict[str, Any]], read_version_exact: bool = False) -> list[str]:
    """Stale-but-real reads, min_version, and per process/node monotonic versions.

    ``read_version_exact``: the ``node_version`` of a read is exactly the version its value
    was read at. Then a read must also be a consistent snapshot (no acknowledged write of
    the key between the value's version and the node version). metakv's HTTP layer takes
    X-Metadata-Version when the response starts, which may be after later applies, so for
    real runs this stays off and only ``mod_version <= node_version`` is required."""
    anomalies: list[str] = []
    writes = _writes_by_key(records)
    writer_of: dict[tuple[str, str], tuple[int, dict[str, Any]]] = {}
    for key, key_writes in writes.items():
        for op_id, record in key_writes:
            if record.get("value") is not None:
                writer_of[(key, record["value"])] = (op_id, record)
    changes_of = {key: _ok_write_versions(key_writes) for key, key_writes in writes.items()}
    may_delete_of = {key: _may_delete(key_writes) for key, key_writes in writes.items()}
    incarnations = _node_incarnations(records)
    last_version: dict[tuple[str, Any, int], tuple[int, int]] = {}
    for op_id, record in sorted(enumerate(records), key=lambda item: _record_invoke(item[1])):
        if record["op"] != "read" or record["outcome"] != "ok":
            continue
        result = record["result"]
        key = record["key"]
        node_version = result.get("node_version")
        where = f"read #{op_id} p{record['process']} {key!r} ({record.get('consistency')}) on node {result.get('node')}"
        min_version = record.get("min_version")
        if min_version is not None and node_version is not None and node_version < min_version:
            anomalies.append(f"{where}: asked min_version {min_version}, answered at version {node_version}")
        if node_version is not None:
            incarnation = _incarnation_of(incarnations, result.get("node"), record)
            if incarnation is not None:
                client = (str(record["process"]), result.get("node"), incarnation)
                previous = last_version.get(client)
                if previous is not None and node_version < previous[0]:
                    anomalies.append(
                        f"{where}: node version went back from {previous[0]} (read #{previous[1]}) to {node_version}")
                last_version[client] = (node_version, op_id)
        changes = changes_of.get(key, [])
        if result.get("found"):
            anomalies.extend(_check_present_read(where, record, result, writer_of, changes, read_version_exact))
        elif node_version is not None and read_version_exact:
            below = bisect.bisect_right(changes, (node_version, "~", 0))
            if below and changes[below - 1][1] == "put" and not may_delete_of.get(key, False):
                last = changes[below - 1]
                anomalies.append(f"{where}: absent at version {node_version}, but write #{last[2]} "
                                 f"put it at version {last[0]} and no delete followed")
    return anomalies


def _check_present_read(where: str, record: dict[str, Any], result: dict[str, Any],
                        writer_of: dict[tuple[str, str], tuple[int, dict[str, Any]]],
                        changes: list[tuple[int, str, int]], read_version_exact: bool) -> list[str]:
    anomalies = []
    key, value = record["key"], result["value"]
    mod_version = result.get("mod_version")
    node_version = result.get("node_version")
    writer = writer_of.get((key, value))
    if writer is None:
        return [f"{where}: saw {value!r}, which no operation wrote"]
    writer_id, writer_record = writer
    if _record_invoke(writer_record) > int(record["complete_ns"]):
        anomalies.append(f"{where}: saw {value!r} from the future: write #{writer_id} was invoked after the read completed")
    writer_version = (writer_record.get("result") or {}).get("version")
    if writer_record["outcome"] == "ok" and writer_version is not None and mod_version is not None \
            and writer_version != mod_version:
        anomalies.append(f"{where}: saw {value!r} at mod_version {mod_version}, but write #{writer_id} produced version {writer_version}")
    if mod_version is not None and node_version is not None:
        if mod_version > node_version:
            anomalies.append(f"{where}: mod_version {mod_version} is above the node's version {node_version}")
        first = bisect.bisect_right(changes, (mod_version, "~", 0))
        if read_version_exact and first < len(changes) and changes[first][0] <= node_version:
            skipped = changes[first]
            anomalies.append(f"{where}: saw {value!r}@{mod_version} at node version {node_version}, "
                             f"but write #{skipped[2]} changed the key at version {skipped[0]}")
    return anomalies


def _node_incarnations(records: list[dict[str, Any]]) -> dict[Any, list[tuple[int, int]]]:
    """Per node, the (start_ns, end_ns) windows of its restarts (nemesis records)."""
    windows: dict[Any, list[tuple[int, int]]] = defaultdict(list)
    for record in records:
        if record["op"] == "nemesis" and record.get("restarts_nodes"):
            end = record.get("complete_ns") or record["invoke_ns"]
            for node in record["restarts_nodes"]:
                windows[node].append((int(record["invoke_ns"]), int(end)))
    return windows


def _incarnation_of(windows: dict[Any, list[tuple[int, int]]], node: Any, record: dict[str, Any]) -> int | None:
    """Which incarnation of ``node`` served this read; None when it straddles a restart."""
    invoke, complete = _record_invoke(record), int(record["complete_ns"])
    incarnation = 0
    for start, end in windows.get(node, []):
        if complete < start:
            break
        if invoke > end:
            incarnation += 1
            continue
        return None
    return incarnation


def check_watches(records: list[dict[str, Any]]) -> list[str]:
    """Watch streams: in order, real, and complete over the ranges they covered."""
    anomalies: list[str] = []
    writes = _writes_by_key(records)
    known: dict[tuple[str, int], tuple[str, Any]] = {}
    for key, key_writes in writes.items():
        for version, kind, op_id in _ok_write_versions(key_writes):
            record = records[op_id]
            known[(key, version)] = (kind, record.get("value"))
    values_written = {(key, record.get("value")) for key, ws in writes.items() for _, record in ws}
    for op_id, record in enumerate(records):
        if record["op"] != "watch" or record["outcome"] != "ok":
            continue
        result = record["result"]
        prefix = record.get("prefix", "")
        where = f"watch #{op_id} p{record['process']} since {record['since']}"
        last = record["since"]
        seen: set[tuple[str, int]] = set()
        for event in result["events"]:
            version = event["mod_version"]
            if version <= record["since"]:
                anomalies.append(f"{where}: event {event['key']!r}@{version} is not after since")
            if version < last:
                anomalies.append(f"{where}: event {event['key']!r}@{version} after version {last}: out of order")
            last = max(last, version)
            seen.add((event["key"], version))
            expected = known.get((event["key"], version))
            if expected is not None:
                if expected[0] != event["type"] or (event["type"] == "put" and expected[1] != event.get("value")):
                    anomalies.append(f"{where}: event {event} does not match the write at that version {expected}")
            elif event["type"] == "put" and (event["key"], event.get("value")) not in values_written:
                anomalies.append(f"{where}: event {event} matches no write")
        covered_until = result["version"]
        for (key, version), (_kind, _value) in known.items():
            if key.startswith(prefix) and record["since"] < version <= covered_until and (key, version) not in seen:
                anomalies.append(f"{where}: covered up to {covered_until} but missed the write to {key!r} at version {version}")
    return anomalies


def check_final(records: list[dict[str, Any]]) -> list[str]:
    """After the final heal: all nodes agree, and no acknowledged write is lost."""
    anomalies: list[str] = []
    finals = [r for r in records if r["op"] == "final_read"]
    if not finals:
        return ["no final reads recorded: the cluster did not recover after the heal"]
    writes = _writes_by_key(records)
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in finals:
        by_key[record["key"]].append(record)
    for key, reads in sorted(by_key.items()):
        observed = {(r["result"].get("found"), r["result"].get("value"), r["result"].get("mod_version")) for r in reads}
        if len(observed) > 1:
            nodes = {r["result"].get("node"): r["result"] for r in reads}
            anomalies.append(f"final {key!r}: nodes disagree at the same version: {nodes}")
        found, value, mod_version = next(iter(observed))
        changes = _ok_write_versions(writes.get(key, []))
        if not changes:
            continue
        newest_version, newest_kind, newest_id = changes[-1]
        if found and mod_version is not None and mod_version < newest_version:
            anomalies.append(f"final {key!r}: lost write #{newest_id} ({newest_kind} at version {newest_version}); "
                             f"the key holds {value!r}@{mod_version}")
        if not found and newest_kind == "put" and not _may_delete(writes.get(key, [])):
            anomalies.append(f"final {key!r}: lost write #{newest_id} (put at version {newest_version}); the key is absent")
    return anomalies


def check_history(records: list[dict[str, Any]], require_final: bool = True,
                  read_version_exact: bool = False) -> CheckReport:
    """Run every check over a history (a list of JSON records); see the module docstring."""
    import time

    started = time.perf_counter()
    key_results, checked = check_linearizable(records)
    anomalies = check_reads(records, read_version_exact) + check_watches(records)
    if require_final:
        anomalies += check_final(records)
    ok = all(result.ok for result in key_results) and not anomalies
    return CheckReport(ok, key_results, anomalies, len(records), checked, time.perf_counter() - started)


def final_read_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["op"] == "final_read"]


def main(argv: list[str] | None = None) -> int:
    """python -m tests.chaos.checker HISTORY.jsonl: print the verdict; exit 1 when invalid."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("history", type=Path)
    args = parser.parse_args(argv)
    report = check_history(load_history(args.history))
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
