"""The watch verifier and the CAS ledger must catch what a user would call a bug."""

from __future__ import annotations

from loadtest.checks import CasLedger, WatchVerifier
from loadtest.stores import WatchBatch, WatchEvent


def _recorder(rows: list[tuple[str, float, str | None]]):
    return lambda name, ms, error: rows.append((name, ms, error))


def _event(version: int) -> WatchEvent:
    return WatchEvent("put", f"k{version}", version, b"v")


def test_every_acknowledged_write_delivered_in_order_passes() -> None:
    rows: list[tuple[str, float, str | None]] = []
    verifier = WatchVerifier("w", _recorder(rows))
    verifier.on_ack(5, 100.0)
    verifier.on_batch(WatchBatch(6, [_event(5)]))
    verifier.on_batch(WatchBatch(0, [_event(7)]))  # the event can beat the acknowledgement
    verifier.on_ack(7, 100.0)
    verifier.finish()
    assert (verifier.acked, verifier.delivered, verifier.missed, verifier.out_of_order) == (2, 2, 0, 0)
    assert [name for name, _, error in rows if error is None] == ["watch delivery", "watch delivery"]


def test_a_skipped_write_is_reported_missing() -> None:
    rows: list[tuple[str, float, str | None]] = []
    verifier = WatchVerifier("w", _recorder(rows))
    verifier.on_ack(5, 0.0)
    verifier.on_ack(6, 0.0)
    verifier.on_batch(WatchBatch(0, [_event(6)]))
    assert verifier.missed == 1
    assert any(name == "check: watch order" and error and "version 5" in error for name, _, error in rows)


def test_a_long_poll_answer_complete_through_a_version_must_hold_its_writes() -> None:
    verifier = WatchVerifier("w", _recorder([]))
    verifier.on_ack(5, 0.0)
    verifier.on_batch(WatchBatch(9, []))  # "complete through 9" yet write 5 is absent
    assert verifier.missed == 1


def test_events_out_of_order_are_reported() -> None:
    verifier = WatchVerifier("w", _recorder([]))
    verifier.on_batch(WatchBatch(0, [_event(8), _event(7)]))
    assert verifier.out_of_order == 1


def test_undelivered_writes_fail_at_the_end() -> None:
    verifier = WatchVerifier("w", _recorder([]))
    verifier.on_ack(3, 0.0)
    assert not verifier.caught_up()
    verifier.finish()
    assert verifier.missed == 1


def test_cas_ledger_accepts_only_values_explained_by_wins_and_undecided_attempts() -> None:
    ledger = CasLedger()
    ledger.wins["a"] = 10
    ledger.undecided["a"] = 2
    assert ledger.verdict({"a": 10})["ok"]
    assert ledger.verdict({"a": 12})["ok"]
    assert not ledger.verdict({"a": 9})["ok"]  # a won increment was lost
    assert not ledger.verdict({"a": 13})["ok"]  # an increment nobody made
