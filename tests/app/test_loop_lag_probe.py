"""The event loop's lag as /metrics shows it: a loop thread kept busy shows up as lag."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from app.runtime_metrics import LoopLagProbe

BLOCK_S = 0.3
BUCKETS_S = (0.001, 0.01, 0.1, 1.0)


def _sample(registry: CollectorRegistry, suffix: str) -> float:
    value = registry.get_sample_value(f"metakv_event_loop_lag_seconds_{suffix}")
    assert value is not None
    return value


def test_a_blocked_loop_is_reported_as_lag_and_stop_ends_the_sampling() -> None:
    registry = CollectorRegistry()
    probe = LoopLagProbe(registry, BUCKETS_S, interval_s=0.01)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        probe.start(loop)
        await asyncio.sleep(0.05)
        loop.call_soon(time.sleep, BLOCK_S)  # a callback holding the loop thread
        await asyncio.sleep(0.05)
        probe.stop()
        count = _sample(registry, "count")
        await asyncio.sleep(0.05)
        assert _sample(registry, "count") == count  # stopped: no more samples

    asyncio.run(scenario())
    # The timer due during the block ran late by most of it; nothing else was late by more.
    assert _sample(registry, "sum") >= BLOCK_S - 0.02
    within_100_ms = registry.get_sample_value("metakv_event_loop_lag_seconds_bucket", {"le": "0.1"})
    assert within_100_ms is not None and _sample(registry, "count") - within_100_ms >= 1
