"""Prometheus gauges read from the live node at scrape time, and the event loop's lag."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from raft.node import Role

if TYPE_CHECKING:
    from app.runtime import NodeRuntime


class StateCollector(Collector):
    """Gauges read from the live node at scrape time (no bookkeeping on the hot path)."""

    def __init__(self, runtime: NodeRuntime, now_ms: Callable[[], int]) -> None:
        self._runtime = runtime
        self._now_ms = now_ms  # the clock the core runs on

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        runtime = self._runtime
        if not runtime.started:
            return
        node = runtime.node
        role = GaugeMetricFamily("metakv_role", "1 for this node's current raft role", labels=["role"])
        for candidate in Role:
            role.add_metric([candidate.name.lower()], 1.0 if node.role == candidate else 0.0)
        yield role
        yield GaugeMetricFamily("metakv_epoch", "Current raft epoch", value=node.epoch)
        yield GaugeMetricFamily("metakv_high_watermark", "Committed offset known to this node",
                                value=node.high_watermark)
        yield GaugeMetricFamily("metakv_applied_version", "Version applied to the state machine",
                                value=runtime.applied_version)
        yield GaugeMetricFamily("metakv_log_end_offset", "Next offset of the local log",
                                value=runtime.log.end_offset())
        yield GaugeMetricFamily("metakv_ready", "1 when consistent reads are served", value=float(runtime.is_ready()))
        lag = GaugeMetricFamily("metakv_fetch_lag_records",
                                "Leader only: records each replica is behind the high watermark",
                                labels=["replica_id", "kind"])
        if node.role == Role.LEADER:
            described = node.describe_quorum(self._now_ms())
            for kind, states in (("voter", described.voters), ("observer", described.observers)):
                for state in states:
                    lag.add_metric([str(state.replica_id), kind],
                                   max(0, described.high_watermark - state.log_end_offset))
        yield lag
        stats = runtime.transport.stats
        closed = CounterMetricFamily("metakv_raft_connections_closed",
                                     "Raft connections the node closed for a cap, by reason", labels=["reason"])
        closed.add_metric(["handshake_cap"], stats.connections_over_handshake_cap)
        closed.add_metric(["replaced"], stats.connections_replaced)
        yield closed


LOOP_LAG_PROBE_S = 0.05  # how often the loop's lateness is sampled (20 timers a second)


class LoopLagProbe:
    """How late the event loop runs a timer: what a request, a fetch or a finished flush
    that arrives at a random moment waits before the loop thread gets to it (a long
    callback, another thread holding the GIL, or the OS running other processes)."""

    def __init__(self, registry: CollectorRegistry, buckets: Sequence[float],
                 interval_s: float = LOOP_LAG_PROBE_S) -> None:
        self._lag = Histogram("metakv_event_loop_lag_seconds",
                              "How late the event loop ran a timer, sampled every "
                              f"{interval_s * 1000:g} ms", registry=registry, buckets=buckets)
        self._interval_s = interval_s
        self._timer: asyncio.TimerHandle | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._schedule(loop)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        due = loop.time() + self._interval_s
        self._timer = loop.call_at(due, self._fired, loop, due)

    def _fired(self, loop: asyncio.AbstractEventLoop, due: float) -> None:
        self._lag.observe(max(0.0, loop.time() - due))
        self._schedule(loop)
