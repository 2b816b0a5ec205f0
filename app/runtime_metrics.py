"""Prometheus gauges read from the live node at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from raft.node import Role

if TYPE_CHECKING:
    from app.runtime import NodeRuntime


class StateCollector(Collector):
    """Gauges read from the live node at scrape time (no bookkeeping on the hot path)."""

    def __init__(self, runtime: NodeRuntime, now_ms: Callable[[], int]) -> None:
        self._runtime = runtime
        self._now_ms = now_ms  # the clock the core runs on

    def collect(self) -> Iterable[GaugeMetricFamily]:
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
