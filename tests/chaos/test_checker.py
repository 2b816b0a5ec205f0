"""The checker on its own: hand-built bad histories are rejected, valid ones accepted."""

from __future__ import annotations

import time
from typing import Any

from tests.chaos.checker import check_history
from tests.chaos.simulated import simulate_history

MS = 1_000_000


class History:
    """Builds records by hand: times in milliseconds, versions as the store would give."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def _add(self, process: int, op: str, key: str, start: float, end: float | None,
             outcome: str, result: dict[str, Any], **fields: Any) -> None:
        record = {"process": process, "op": op, "key": key, "invoke_ns": int(start * MS),
                  "complete_ns": None if end is None else int(end * MS), "outcome": outcome,
                  "result": result, **fields}
        self.records.append(record)

    def put(self, p: int, key: str, value: str, start: float, end: float | None, version: int | None,
            created: bool | None = None) -> None:
        result: dict[str, Any] = {} if version is None else {"version": version}
        if created is not None:
            result["created"] = created
        self._add(p, "put", key, start, end, "ok" if version is not None else "indeterminate", result, value=value)

    def cas(self, p: int, key: str, value: str, expected: int, start: float, end: float | None,
            version: int | None, outcome: str = "ok") -> None:
        result = {} if version is None else {"version": version}
        self._add(p, "cas", key, start, end, outcome, result, value=value, expected_version=expected)

    def delete(self, p: int, key: str, start: float, end: float | None, version: int | None,
               deleted: bool = True) -> None:
        outcome = "ok" if version is not None else "indeterminate"
        result = {} if version is None else {"version": version, "deleted": deleted}
        self._add(p, "delete", key, start, end, outcome, result)

    def txn_value(self, p: int, key: str, expected_value: str, value: str, start: float, end: float,
                  version: int | None, read: tuple[str, int] | None = None) -> None:
        if version is not None:
            self._add(p, "txn", key, start, end, "ok", {"version": version}, value=value,
                      compare=["value", expected_value], success_op="put")
        else:
            self._add(p, "txn", key, start, end, "fail", {"read": self.read_result(read, 0)}, value=value,
                      compare=["value", expected_value], success_op="put")

    @staticmethod
    def read_result(seen: tuple[str, int] | None, node_version: int, node: int = 1) -> dict[str, Any]:
        if seen is None:
            return {"found": False, "node_version": node_version, "node": node}
        return {"found": True, "value": seen[0], "mod_version": seen[1], "node_version": node_version, "node": node}

    def read(self, p: int, key: str, start: float, end: float, seen: tuple[str, int] | None,
             node_version: int, consistency: str = "linearizable", node: int = 1,
             min_version: int | None = None) -> None:
        self._add(p, "read", key, start, end, "ok", self.read_result(seen, node_version, node),
                  consistency=consistency, min_version=min_version)

    def final(self, key: str, at: float, seen: tuple[str, int] | None, node_version: int,
              nodes: tuple[int, ...] = (1, 2, 3)) -> None:
        self.read(99, key, at, at + 1, seen, node_version)
        for node in nodes:
            self._add(99, "final_read", key, at + 2, at + 3, "ok", self.read_result(seen, node_version, node))

    def watch(self, p: int, since: int, version: int, events: list[dict[str, Any]], start: float, end: float) -> None:
        self._add(p, "watch", "", start, end, "ok", {"version": version, "events": events}, since=since, prefix="")

    def check(self, require_final: bool = True):
        # hand-built reads carry the exact version they were read at
        return check_history(self.records, require_final=require_final, read_version_exact=True)


def assert_invalid(history: History, *phrases: str, require_final: bool = True) -> str:
    report = history.check(require_final)
    text = report.summary()
    print(text)
    assert not report.ok, text
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in report:\n{text}"
    return text


def assert_valid(history: History, require_final: bool = True) -> None:
    report = history.check(require_final)
    assert report.ok, report.summary()


# ------------------------------------------------------------------ rejected histories


def test_stale_linearizable_read_is_rejected() -> None:
    h = History()
    h.put(1, "k", "a", 0, 10, version=1)
    h.put(1, "k", "b", 20, 30, version=2)
    h.read(2, "k", 40, 50, seen=("a", 1), node_version=1)  # invoked after b was acknowledged
    h.final("k", 100, ("b", 2), 2)
    text = assert_invalid(h, "key 'k'", "no linearization", "saw 'a' but the key holds 'b'")
    assert "#2 p2 read" in text  # the stale read is named


def test_lost_write_is_rejected() -> None:
    h = History()
    h.put(1, "k", "a", 0, 10, version=1, created=True)
    h.put(2, "k", "b", 20, 30, version=2, created=False)
    h.final("k", 100, ("a", 1), 2)  # the acknowledged b is gone after the heal
    assert_invalid(h, "key 'k'", "final 'k': lost write #1 (put at version 2)")


def test_lost_write_to_absent_is_rejected() -> None:
    h = History()
    h.put(1, "k", "a", 0, 10, version=1, created=True)
    h.final("k", 100, None, 5)
    assert_invalid(h, "saw absent but the key holds 'a'", "final 'k': lost write #0")


def test_reordered_cas_is_rejected() -> None:
    h = History()
    h.put(1, "k", "a", 0, 10, version=1)
    # the second CAS expects the version the first produces, but completes before the first began
    h.cas(2, "k", "c", expected=2, start=20, end=30, version=3)
    h.cas(1, "k", "b", expected=1, start=40, end=50, version=2)
    h.final("k", 100, ("c", 3), 3)
    assert_invalid(h, "key 'k'", "condition mod_version=2 held but the key is 'a' with mod_version 1")


def test_two_cas_on_the_same_version_are_rejected() -> None:
    h = History()
    h.put(1, "k", "a", 0, 10, version=1)
    h.cas(1, "k", "b", expected=1, start=20, end=40, version=2)
    h.cas(2, "k", "c", expected=1, start=20, end=40, version=3)  # lost update
    h.final("k", 100, ("c", 3), 3)
    assert_invalid(h, "key 'k'", "no linearization")


def test_duplicated_write_is_rejected() -> None:
    h = History()
    h.put(1, "k", "a", 0, 10, version=1)
    h.put(2, "k", "b", 20, 30, version=2)
    # a retried "a" applied a second time: the read sees a at a version nothing produced
    h.read(3, "k", 40, 50, seen=("a", 3), node_version=3)
    h.final("k", 100, ("a", 3), 3)
    assert_invalid(h, "key 'k'", "saw 'a' at mod_version 3, but write #0 produced version 1")


def test_txn_value_compare_against_wrong_value_is_rejected() -> None:
    h = History()
    h.put(1, "k", "a", 0, 10, version=1)
    h.txn_value(2, "k", expected_value="a", value="b", start=20, end=30, version=None, read=("a", 1))
    h.final("k", 100, ("a", 1), 1)
    assert_invalid(h, "condition value='a' failed but the key is 'a'")


def test_local_read_from_the_future_is_rejected() -> None:
    h = History()
    h.read(2, "k", 0, 5, seen=("a", 1), node_version=1, consistency="local")
    h.put(1, "k", "a", 10, 20, version=1)
    h.final("k", 100, ("a", 1), 1)
    assert_invalid(h, "from the future")


def test_local_read_going_backwards_for_one_client_is_rejected() -> None:
    h = History()
    h.put(1, "k", "a", 0, 10, version=1)
    h.put(1, "k", "b", 20, 30, version=2)
    h.read(2, "k", 40, 45, seen=("b", 2), node_version=2, consistency="local", node=2)
    h.read(2, "k", 50, 55, seen=("a", 1), node_version=1, consistency="local", node=2)
    h.final("k", 100, ("b", 2), 2)
    assert_invalid(h, "node version went back from 2")


def test_local_read_inconsistent_with_its_version_is_rejected() -> None:
    h = History()
    h.put(1, "k", "a", 0, 10, version=1)
    h.put(1, "k", "b", 20, 30, version=2)
    h.read(2, "k", 40, 45, seen=("a", 1), node_version=2, consistency="local")
    h.final("k", 100, ("b", 2), 2)
    assert_invalid(h, "write #1 changed the key at version 2")


def test_min_version_read_going_back_is_rejected() -> None:
    h = History()
    h.put(1, "k", "a", 0, 10, version=1)
    h.put(1, "k", "b", 20, 30, version=2)
    h.read(1, "k", 40, 45, seen=("a", 1), node_version=1, consistency="local", min_version=2)
    h.final("k", 100, ("b", 2), 2)
    assert_invalid(h, "asked min_version 2, answered at version 1")


def test_watch_missing_or_reordering_events_is_rejected() -> None:
    h = History()
    h.put(1, "k", "a", 0, 10, version=1)
    h.put(1, "j", "b", 20, 30, version=2)
    h.put(1, "k", "c", 40, 50, version=3)
    h.watch(5, since=0, version=3, events=[
        {"type": "put", "key": "k", "mod_version": 3, "value": "c"},
        {"type": "put", "key": "k", "mod_version": 1, "value": "a"},
    ], start=0, end=60)
    h.final("k", 100, ("c", 3), 3)
    h.final("j", 100, ("b", 2), 3)
    assert_invalid(h, "out of order", "missed the write to 'j' at version 2")


def test_nodes_disagreeing_after_heal_is_rejected() -> None:
    h = History()
    h.put(1, "k", "a", 0, 10, version=1)
    h.read(99, "k", 100, 101, ("a", 1), 1)
    for node, seen in ((1, ("a", 1)), (2, ("a", 1)), (3, None)):
        h._add(99, "final_read", "k", 102, 103, "ok", h.read_result(seen, 1, node))
    assert_invalid(h, "nodes disagree")


# ------------------------------------------------------------------ accepted histories


def test_concurrent_read_may_see_old_or_new() -> None:
    for seen in (("a", 1), ("b", 2)):
        h = History()
        h.put(1, "k", "a", 0, 10, version=1)
        h.put(1, "k", "b", 20, 40, version=2)
        h.read(2, "k", 25, 35, seen=seen, node_version=seen[1])
        h.final("k", 100, ("b", 2), 2)
        assert_valid(h)


def test_reads_order_must_agree_but_overlapping_reads_may_differ() -> None:
    h = History()
    h.put(1, "k", "a", 0, 10, version=1)
    h.put(1, "k", "b", 20, 60, version=2)
    h.read(2, "k", 25, 35, seen=("b", 2), node_version=2)
    h.read(3, "k", 30, 50, seen=("a", 1), node_version=1)  # overlaps the first read: a then b
    h.final("k", 100, ("b", 2), 2)
    assert_valid(h)
    h2 = History()
    h2.put(1, "k", "a", 0, 10, version=1)
    h2.put(1, "k", "b", 20, 60, version=2)
    h2.read(2, "k", 25, 35, seen=("b", 2), node_version=2)
    h2.read(3, "k", 40, 50, seen=("a", 1), node_version=1)  # strictly after a read of b
    h2.final("k", 100, ("b", 2), 2)
    assert_invalid(h2, "no linearization")


def test_indeterminate_write_may_take_effect_late() -> None:
    h = History()
    h.put(1, "k", "a", 0, 10, version=1)
    h.put(2, "k", "x", 20, None, version=None)  # the client timed out
    h.read(3, "k", 30, 40, seen=("a", 1), node_version=1)
    h.read(3, "k", 500, 510, seen=("x", 2), node_version=2)  # it landed much later
    h.cas(3, "k", "y", expected=2, start=520, end=530, version=3)
    h.final("k", 1000, ("y", 3), 3)
    assert_valid(h)


def test_indeterminate_write_may_never_take_effect() -> None:
    h = History()
    h.put(1, "k", "a", 0, 10, version=1)
    h.put(2, "k", "x", 20, None, version=None)
    h.delete(2, "k", 30, None, version=None)
    h.read(3, "k", 500, 510, seen=("a", 1), node_version=1)
    h.final("k", 1000, ("a", 1), 1)
    assert_valid(h)


def test_indeterminate_delete_then_absent_final() -> None:
    h = History()
    h.put(1, "k", "a", 0, 10, version=1, created=True)
    h.delete(2, "k", 20, None, version=None)
    h.final("k", 1000, None, 2)
    assert_valid(h)


def test_cas_failure_against_unknown_version_is_accepted() -> None:
    h = History()
    h.put(2, "k", "x", 0, None, version=None)
    h.cas(1, "k", "y", expected=7, start=10, end=20, version=None, outcome="fail")
    h.read(1, "k", 30, 40, seen=("x", 3), node_version=3)
    h.final("k", 100, ("x", 3), 3)
    assert_valid(h)


def test_value_txn_and_delete_history_is_accepted() -> None:
    h = History()
    h.put(1, "k", "a", 0, 10, version=1, created=True)
    h.txn_value(2, "k", expected_value="a", value="b", start=20, end=30, version=2)
    h.txn_value(1, "k", expected_value="a", value="c", start=25, end=35, version=None, read=("b", 2))
    h.delete(1, "k", 40, 50, version=3, deleted=True)
    h.delete(2, "k", 45, 55, version=3, deleted=False)
    h.read(2, "k", 60, 61, None, 3, consistency="local")
    h.put(2, "k", "d", 70, 80, version=4, created=True)
    h.watch(5, since=0, version=4, events=[
        {"type": "put", "key": "k", "mod_version": 1, "value": "a"},
        {"type": "put", "key": "k", "mod_version": 2, "value": "b"},
        {"type": "delete", "key": "k", "mod_version": 3},
        {"type": "put", "key": "k", "mod_version": 4, "value": "d"},
    ], start=0, end=90)
    h.final("k", 100, ("d", 4), 4)
    assert_valid(h)


def test_simulated_concurrent_histories_are_accepted() -> None:
    for seed in range(20):
        records = simulate_history(seed, op_count=400, process_count=6, key_count=3, indeterminate_rate=0.05)
        report = check_history(records, read_version_exact=True)
        assert report.ok, f"seed {seed}: {report.summary()}"


def test_corrupted_simulated_history_is_rejected() -> None:
    records = simulate_history(7, op_count=400, process_count=6, key_count=3, indeterminate_rate=0.05)
    # make one acknowledged linearizable read see the value before the latest write
    reads = [r for r in records if r["op"] == "read" and r.get("consistency") == "linearizable"
             and r["result"].get("found") and r["process"] != "final"]
    victim = reads[len(reads) // 2]
    victim["result"]["value"] = "never-written"
    report = check_history(records, read_version_exact=True)
    assert not report.ok
    assert "never-written" in report.summary()


def test_ten_thousand_operations_check_in_seconds() -> None:
    records = simulate_history(2026, op_count=10_000, process_count=12, key_count=8, indeterminate_rate=0.02)
    started = time.perf_counter()
    report = check_history(records, read_version_exact=True)
    elapsed_s = time.perf_counter() - started
    print(f"\nchecked {report.op_count} records ({report.checked_op_count} register ops, "
          f"{sum(k.configurations for k in report.keys)} configurations) in {elapsed_s:.2f} s")
    assert report.ok, report.summary()
    assert report.checked_op_count > 7000


def test_simulated_histories_with_many_indeterminate_ops_are_accepted() -> None:
    for seed in range(10):
        records = simulate_history(seed, op_count=600, process_count=8, key_count=2, indeterminate_rate=0.25)
        report = check_history(records, read_version_exact=True)
        assert report.ok, f"seed {seed}: {report.summary()}"


def test_chain_of_observed_indeterminate_writes_is_accepted() -> None:
    h = History()
    h.put(1, "k", "a", 0, None, version=None)  # indeterminate, later compared by value
    h._add(2, "txn", "k", 5, None, "indeterminate", {}, value="b", compare=["value", "a"], success_op="put")
    h.read(3, "k", 50, 60, seen=("b", 2), node_version=2)
    h.final("k", 100, ("b", 2), 2)
    assert_valid(h)
    # the same chain with the first write never applied cannot explain the read of b
    h2 = History()
    h2._add(2, "txn", "k", 5, None, "indeterminate", {}, value="b", compare=["value", "a"], success_op="put")
    h2.read(3, "k", 50, 60, seen=("b", 2), node_version=2)
    h2.final("k", 100, ("b", 2), 2)
    assert_invalid(h2, "condition value='a' held but the key is absent")
