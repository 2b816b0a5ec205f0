"""The dashboard's plots: writes per second, commit latency and apply lag over the last
minutes, from this node's own metrics registry.

Samples are taken when a dashboard asks (at most one per ``SAMPLE_INTERVAL_S``), not by a
timer: a node nobody watches does no work for the dashboard, and the plots show a gap for
the time no tab was open.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

SAMPLE_INTERVAL_S = 2.0
HISTORY_SAMPLES = 300  # ten minutes at one sample every two seconds
_WANTED = {
    "metakv_applied_version": "applied_version",
    "metakv_high_watermark": "high_watermark",
    "metakv_commit_latency_seconds_sum": "commit_seconds_sum",
    "metakv_commit_latency_seconds_count": "commit_count",
}


@dataclass(frozen=True, slots=True)
class Sample:
    wall_ms: int
    monotonic_s: float
    applied_version: float
    high_watermark: float
    commit_seconds_sum: float
    commit_count: float


class MetricsHistory:
    def __init__(self, registry: CollectorRegistry, clock: Any = time.monotonic) -> None:
        self.registry = registry
        self._clock = clock
        self._samples: deque[Sample] = deque(maxlen=HISTORY_SAMPLES)
        self._encoded = b""

    def encoded(self, node_id: int) -> bytes:
        """``{"node_id", "points"}`` as JSON, encoded again only after a new sample."""
        now_s = self._clock()
        if not self._samples or now_s - self._samples[-1].monotonic_s >= SAMPLE_INTERVAL_S:
            self._samples.append(self._sample(now_s))
            self._encoded = b""
        if not self._encoded:
            self._encoded = orjson.dumps({"node_id": node_id, "points": self.points()})
        return self._encoded

    def points(self) -> list[dict[str, Any]]:
        """Every interval between two consecutive samples as one point (None where nothing
        was measured)."""
        samples = list(self._samples)
        points = []
        for before, after in zip(samples, samples[1:], strict=False):
            elapsed_s = after.monotonic_s - before.monotonic_s
            if elapsed_s > 3 * SAMPLE_INTERVAL_S:
                points.append({"t": after.wall_ms, "gap": True})  # no tab was open in between
                continue
            commits = after.commit_count - before.commit_count
            points.append({
                "t": after.wall_ms,
                "writes_per_s": max(0.0, after.applied_version - before.applied_version) / elapsed_s,
                "commit_latency_ms": (1000 * (after.commit_seconds_sum - before.commit_seconds_sum) / commits
                                      if commits > 0 else None),
                "apply_lag": max(0.0, after.high_watermark - after.applied_version),
            })
        return points

    def _sample(self, now_s: float) -> Sample:
        values = dict.fromkeys(_WANTED.values(), 0.0)
        for metric in self.registry.collect():
            for sample in metric.samples:
                field = _WANTED.get(sample.name)
                if field is not None and not sample.labels:
                    values[field] = float(sample.value)
        return Sample(wall_ms=int(time.time() * 1000), monotonic_s=now_s, **values)
