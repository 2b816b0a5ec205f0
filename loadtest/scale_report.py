"""The scale benchmark's figures: which ones a stage yields (for both stores, or for one),
metakv ÷ etcd with the direction that is better, the table printed per stage and the PNG of
cost per operation against store size."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: the figure only goes to a file
import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen

MB = 1e6
SYSTEMS = ("metakv", "etcd")


@dataclass(frozen=True)
class Metric:
    """One figure of a stage, read from one store's section of the stage's results."""

    label: str
    unit: str
    better: str  # "higher" | "lower"
    read: Callable[[dict[str, Any]], float | None]

    @property
    def heading(self) -> str:
        return f"{self.label} ({self.unit})" if self.unit else self.label

    def describe(self) -> dict[str, str]:
        return {"label": self.label, "unit": self.unit, "better": self.better}


def _path(*keys: str, scale: float = 1.0) -> Callable[[dict[str, Any]], float | None]:
    def read(figures: dict[str, Any]) -> float | None:
        value: Any = figures
        for key in keys:
            if not isinstance(value, dict) or value.get(key) is None:
                return None
            value = value[key]
        return round(float(value) / scale, 3)
    return read


def _per_op_us(figures: dict[str, Any]) -> float | None:
    per_s = _path("churn_64_clients", "per_s")(figures)
    return round(1e6 / per_s, 1) if per_s else None


def _largest(field: str) -> Callable[[dict[str, Any]], float | None]:
    def read(figures: dict[str, Any]) -> float | None:
        values = [node.get(field) for node in figures.get("resources", {}).get("nodes", {}).values()]
        known = [value for value in values if value is not None]
        return round(max(known) / MB, 1) if known else None
    return read


# Figures both stores have; ratio = metakv ÷ etcd.
METRICS: dict[str, Metric] = {
    "growth_per_s": Metric("growth, 64 clients (new keys)", "req/s", "higher", _path("growth", "per_s")),
    "churn_per_s": Metric("churn, 64 clients", "req/s", "higher", _path("churn_64_clients", "per_s")),
    "churn_us_per_op": Metric("churn, 64 clients: cost per op (1/throughput)", "µs", "lower", _per_op_us),
    "churn_p99_ms": Metric("churn, 64 clients: p99", "ms", "lower", _path("churn_64_clients", "latency_ms_p99")),
    "churn_server_cpu_ms_per_op": Metric("churn, 64 clients: servers' CPU per request", "ms", "lower",
                                         _path("churn_64_clients", "servers_cpu_ms_per_request")),
    "fixed_rate_achieved_per_s": Metric("churn at 500 req/s: answered", "req/s", "higher",
                                        _path("churn_fixed_rate", "per_s")),
    "fixed_rate_p50_ms": Metric("churn at 500 req/s: p50", "ms", "lower", _path("churn_fixed_rate", "latency_ms_p50")),
    "fixed_rate_p99_ms": Metric("churn at 500 req/s: p99", "ms", "lower", _path("churn_fixed_rate", "latency_ms_p99")),
    "point_read_p50_ms": Metric("point read, 1 client: p50", "ms", "lower",
                                _path("point_read_1_client", "latency_ms_p50")),
    "point_read_p99_ms": Metric("point read, 1 client: p99", "ms", "lower",
                                _path("point_read_1_client", "latency_ms_p99")),
    "list_prefix_p50_ms": Metric("list 100 keys, 1 client: p50", "ms", "lower",
                                 _path("list_prefix_1_client", "latency_ms_p50")),
    "list_prefix_p99_ms": Metric("list 100 keys, 1 client: p99", "ms", "lower",
                                 _path("list_prefix_1_client", "latency_ms_p99")),
    "rss_mb_max": Metric("RSS, largest node", "MB", "lower", _path("resources", "rss_bytes_max", scale=MB)),
    "disk_mb_total": Metric("bytes on disk, 3 nodes", "MB", "lower", _path("resources", "disk_bytes_total", scale=MB)),
}

# Figures of one store only: (store, metric).
METRICS_ONE_SIDED: dict[str, tuple[str, Metric]] = {
    "follower_apply_us_per_record": ("metakv", Metric(
        "follower apply during churn: time per record", "µs", "lower",
        _path("churn_64_clients", "follower_apply", "apply_us_per_record"))),
    "follower_apply_records_per_apply_s": ("metakv", Metric(
        "follower apply: records per second of apply time", "rec/s", "higher",
        _path("churn_64_clients", "follower_apply", "records_per_apply_s"))),
    **{f"leader_loop_lag_{name}_ms": ("metakv", Metric(f"leader event loop lag {during}: mean", "ms", "lower",
                                                       _path(phase, "leader_loop_lag", "mean_ms")))
       for name, during, phase in (("churn", "during churn, 64 clients", "churn_64_clients"),
                                   ("fixed_rate", "at 500 req/s", "churn_fixed_rate"))},
    "state_db_mb_max": ("metakv", Metric("state.db (+ WAL), largest node", "MB", "lower",
                                         _largest("state_db_bytes"))),
    "log_mb_max": ("metakv", Metric("log, largest node", "MB", "lower", _largest("log_bytes"))),
    "history_versions": ("metakv", Metric("history held (applied - oldest version)", "versions", "lower",
                                          _path("resources", "history", "versions"))),
    "cold_restart_s": ("metakv", Metric("cold restart of a follower, to a read at the leader's version", "s",
                                        "lower", _path("cold_restart", "seconds"))),
    "cleaning_s": ("metakv", Metric("cleaning pass on the leader (POST /v1/admin/compact)", "s", "lower",
                                    _path("cleaning", "seconds"))),
    "snapshot_take_s": ("metakv", Metric("snapshot take (POST /v1/admin/snapshot)", "s", "lower",
                                         _path("snapshot_take", "seconds"))),
    "snapshot_mb": ("metakv", Metric("snapshot size", "MB", "lower",
                                     _path("snapshot_take", "snapshot_bytes", scale=MB))),
    "snapshot_download_s": ("metakv", Metric("snapshot download (observer start to 'installing snapshot')",
                                             "s", "lower", _path("snapshot_install", "download_s"))),
    "snapshot_install_s": ("metakv", Metric("snapshot install ('installing snapshot' to a read)", "s", "lower",
                                            _path("snapshot_install", "install_s"))),
    "etcd_db_size_mb_max": ("etcd", Metric("backend db size, largest member", "MB", "lower",
                                           _largest("db_size_bytes"))),
    "etcd_revision": ("etcd", Metric("revision", "", "lower", _path("resources", "nodes", "1", "revision"))),
}


def summarise(stage: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Every figure of the stage by name, per store."""
    summary: dict[str, dict[str, float | None]] = {
        system: {name: metric.read(stage[system]) for name, metric in METRICS.items()} for system in SYSTEMS}
    for name, (system, metric) in METRICS_ONE_SIDED.items():
        summary[system][name] = metric.read(stage[system])
    return summary


def ratios(summary: dict[str, dict[str, float | None]]) -> dict[str, dict[str, Any]]:
    """metakv ÷ etcd per figure, and which store the ratio favours."""
    result: dict[str, dict[str, Any]] = {}
    for name, metric in METRICS.items():
        ours, theirs = summary["metakv"][name], summary["etcd"][name]
        ratio = round(ours / theirs, 3) if ours is not None and theirs else None
        favours = None
        if ratio is not None and ratio != 1:
            favours = "metakv" if (ratio > 1) == (metric.better == "higher") else "etcd"
        result[name] = {"ratio": ratio, "better": metric.better, "favours": favours}
    return result


def _number(value: float | None) -> str:
    if value is None:
        return "n/a"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.2f}"


def stage_table(stage: dict[str, Any]) -> list[str]:
    summary, compared = stage["summary"], stage["metakv_over_etcd"]
    seconds = stage["seconds"]
    lines = [f"stage: {stage['live_keys']:,} live keys (growth {seconds['growth']:.0f} s, phases "
             f"{seconds['phases']:.0f} s, metakv restart/cleaning/snapshots {seconds['metakv_events']:.0f} s, "
             f"whole stage {seconds['total']:.0f} s, load {stage['load_average_1m_after']})",
             "| figure | metakv | etcd | metakv ÷ etcd |", "| --- | ---: | ---: | --- |"]
    for name, metric in METRICS.items():
        entry = compared[name]
        ratio = "n/a" if entry["ratio"] is None else f"{entry['ratio']:.2f}× ({metric.better} is better)"
        lines.append(f"| {metric.heading} | {_number(summary['metakv'][name])} | "
                     f"{_number(summary['etcd'][name])} | {ratio} |")
    for name, (system, metric) in METRICS_ONE_SIDED.items():
        cells = [_number(summary[system][name]) if system == other else "" for other in SYSTEMS]
        lines.append(f"| {metric.heading} | {cells[0]} | {cells[1]} | |")
    if stage["metakv"]["snapshot_install"].get("note"):
        lines.append(f"metakv snapshot install: {stage['metakv']['snapshot_install']['note']}")
    return lines


def print_stage(stage: dict[str, Any]) -> None:
    print("\n".join(stage_table(stage)), flush=True)


PLOTTED = ("churn_us_per_op", "fixed_rate_p99_ms", "point_read_p50_ms", "list_prefix_p50_ms")


def plot(results: dict[str, Any], path: Path) -> None:
    """Cost per operation against live keys, one line per store, one panel per figure."""
    stages = results["stages"]
    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    for axis, name in zip(axes.flat, PLOTTED, strict=True):
        metric = METRICS[name]
        for system in SYSTEMS:
            points = [(stage["live_keys"], stage["summary"][system][name]) for stage in stages
                      if stage["summary"][system][name] is not None]
            if points:
                axis.plot(*zip(*points, strict=True), marker="o", label=system)
        # Both axes logarithmic: a cost that stays flat is a flat line whatever its size,
        # and a thousandfold gap between the stores still shows both lines.
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_title(metric.label, fontsize=10)
        axis.set_xlabel("live keys")
        axis.set_ylabel(metric.unit)
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.suptitle("Cost per operation as the store grows (metakv and etcd, same run, 3 nodes each; log scales)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
