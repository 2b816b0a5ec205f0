"""The cleaner's CPU throttle: background cleaning yields the CPU to the event loop.

Checked with a fake clock: the throttle sleeps after each slice of work for as long as keeps
the thread busy at most its share of the time, and not at all within a slice."""

from __future__ import annotations

import pytest

from raft.types import Batch
from storage import cleaning_run
from storage.cleaner import clean_prefix
from storage.commands import delete, encode_command, put


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0
        self.slept_s: list[float] = []

    def perf_counter(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.slept_s.append(seconds)
        self.now_s += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(cleaning_run.time, "perf_counter", fake.perf_counter)
    monkeypatch.setattr(cleaning_run.time, "sleep", fake.sleep)
    return fake


def test_throttle_keeps_the_busy_share(clock: FakeClock) -> None:
    throttle = cleaning_run.Throttle(busy_share=0.25, slice_s=0.002)
    worked_s = 0.0
    for _ in range(1000):  # 1000 steps of 0.1 ms of work
        clock.now_s += 0.0001
        worked_s += 0.0001
        throttle.pause()
    elapsed_s = clock.now_s - 100.0
    assert sum(clock.slept_s) == pytest.approx(elapsed_s - worked_s)
    assert worked_s / elapsed_s == pytest.approx(0.25, abs=0.02)
    assert len(clock.slept_s) == pytest.approx(worked_s / 0.002, abs=2)  # once per slice


def test_throttle_does_not_sleep_within_a_slice(clock: FakeClock) -> None:
    throttle = cleaning_run.Throttle(busy_share=0.25, slice_s=0.002)
    for _ in range(10):
        clock.now_s += 0.0001
        throttle.pause()
    assert clock.slept_s == []


def test_throttle_refuses_a_share_outside_0_to_1() -> None:
    with pytest.raises(Exception, match="busy_share"):
        cleaning_run.Throttle(busy_share=0.0, slice_s=0.002)


def test_clean_prefix_pauses_between_batches_and_gives_the_same_result() -> None:
    batches = [Batch(offset, 1, 1000 + offset, False,
                     (encode_command(put(f"k{offset % 7}", b"v%d" % offset)), encode_command(delete(f"k{offset % 5}"))))
               for offset in range(0, 600, 2)]
    calls = [0]

    def pause() -> None:
        calls[0] += 1

    end = batches[-1].next_offset
    paused = clean_prefix(batches, end, 0, pause=pause)
    assert calls[0] >= len(batches)
    assert paused == clean_prefix(batches, end, 0)
