"""Builds valid histories from a simulated linearizable register store, for checker tests.

Why: the checker must accept what a correct store produces, including concurrency,
indeterminate operations (some took effect, some did not) and stale-but-real local reads;
a seeded simulation yields such histories at any size. Each operation gets a
linearization point inside [invoke, complete]; applying the operations in that order to
a model store gives every result and version.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class _Planned:
    process: int
    record: dict[str, Any]
    invoke_ns: int
    point_ns: int
    complete_ns: int
    indeterminate: bool
    takes_effect: bool


def simulate_history(seed: int, op_count: int, process_count: int = 10, key_count: int = 10,
                     indeterminate_rate: float = 0.02) -> list[dict[str, Any]]:
    """A valid history of ``op_count`` operations (plus final reads of every key)."""
    rng = random.Random(seed)
    keys = [f"k{i}" for i in range(key_count)]
    planned: list[_Planned] = []
    clock_ns = [rng.randrange(1_000_000) for _ in range(process_count)]
    for number in range(op_count):
        process = number % process_count
        invoke = clock_ns[process] + rng.randrange(10_000, 2_000_000)
        duration = rng.randrange(100_000, 20_000_000)
        point = invoke + rng.randrange(duration)
        complete = invoke + duration
        clock_ns[process] = complete
        key = rng.choice(keys)
        indeterminate = rng.random() < indeterminate_rate
        kind = rng.choices(["read", "local_read", "put", "cas", "delete", "txn", "create"],
                           weights=[30, 15, 25, 10, 5, 10, 5])[0]
        record: dict[str, Any] = {"process": process, "key": key, "op": kind}
        if kind in ("put", "cas", "txn", "create"):
            record["value"] = f"v{process}-{number}"
        planned.append(_Planned(process, record, invoke, point, complete,
                                indeterminate and kind not in ("read", "local_read"), rng.random() < 0.5))
    return _execute(rng, planned, keys)


def _execute(rng: random.Random, planned: list[_Planned], keys: list[str]) -> list[dict[str, Any]]:
    store: dict[str, tuple[str, int]] = {}
    history_of: dict[str, list[tuple[int, tuple[str, int] | None]]] = {k: [(0, None)] for k in keys}
    version = 0
    last_local_version: dict[int, int] = {}
    records = []
    for item in sorted(planned, key=lambda p: p.point_ns):
        record = item.record
        key = record["key"]
        current = store.get(key)
        record["invoke_ns"] = item.invoke_ns
        record["complete_ns"] = item.complete_ns
        record["outcome"] = "ok"
        kind = record["op"]
        if kind == "read":
            record["consistency"] = "linearizable"
            record["result"] = _read_result(current, version)
        elif kind == "local_read":
            record["op"] = "read"
            record["consistency"] = "local"
            floor = max(version - 30, last_local_version.get(item.process, 0))
            stale_version = rng.randrange(floor, version + 1)
            last_local_version[item.process] = stale_version
            record["result"] = _read_result(_state_at(history_of[key], stale_version), stale_version) | {"node": 2}
        else:
            applied = _apply_write(rng, record, current, version + 1)
            if item.indeterminate:
                record["outcome"] = "indeterminate"
                record["result"] = {}
                if not item.takes_effect:
                    applied = None
            if applied is not None:
                version += 1
                if applied[0] == "put":
                    store[key] = (applied[1], version)
                    history_of[key].append((version, (applied[1], version)))
                else:
                    store.pop(key, None)
                    history_of[key].append((version, None))
        records.append(record)
    records.sort(key=lambda r: r["invoke_ns"])
    end_ns = max(r["complete_ns"] for r in records) + 1_000_000
    for key in keys:
        final = {"process": "final", "key": key, "op": "read", "consistency": "linearizable",
                 "invoke_ns": end_ns, "complete_ns": end_ns + 1000, "outcome": "ok",
                 "result": _read_result(store.get(key), version)}
        records.append(final)
        for node in (1, 2, 3):
            result = _read_result(store.get(key), version) | {"node": node}
            records.append({"process": "final", "key": key, "op": "final_read", "invoke_ns": end_ns + 2000,
                            "complete_ns": end_ns + 3000, "outcome": "ok", "result": result})
    return records


def _state_at(history: list[tuple[int, tuple[str, int] | None]], version: int) -> tuple[str, int] | None:
    state = None
    for at, value in history:
        if at > version:
            break
        state = value
    return state


def _read_result(state: tuple[str, int] | None, node_version: int) -> dict[str, Any]:
    if state is None:
        return {"found": False, "node_version": node_version, "node": 1}
    return {"found": True, "value": state[0], "mod_version": state[1], "node_version": node_version, "node": 1}


def _apply_write(rng: random.Random, record: dict[str, Any], current: tuple[str, int] | None,
                 next_version: int) -> tuple[str, Any] | None:
    """Fill in the write's result; return the change it makes (None: no change)."""
    kind = record["op"]
    if kind == "put":
        record["result"] = {"version": next_version, "created": current is None}
        return ("put", record["value"])
    if kind == "delete":
        if current is None:
            record["result"] = {"version": next_version - 1, "deleted": False}
            return None
        record["result"] = {"version": next_version, "deleted": True}
        return ("delete", None)
    if kind == "create":
        if current is not None:
            record["outcome"] = "fail"
            record["result"] = {"current_version": current[1]}
            return None
        record["result"] = {"version": next_version}
        return ("put", record["value"])
    if kind == "cas":
        expected = current[1] if current is not None and rng.random() < 0.7 else rng.randrange(1, next_version + 1)
        record["expected_version"] = expected
        if current is None or current[1] != expected:
            record["outcome"] = "fail"
            record["result"] = {}
            return None
        record["result"] = {"version": next_version}
        return ("put", record["value"])
    # txn comparing the value
    expected_value = current[0] if current is not None and rng.random() < 0.7 else "nothing"
    record["compare"] = ["value", expected_value]
    record["success_op"] = "put"
    if current is None or current[0] != expected_value:
        record["outcome"] = "fail"
        record["result"] = {"read": _read_result(current, next_version - 1)}
        return None
    record["result"] = {"version": next_version}
    return ("put", record["value"])
