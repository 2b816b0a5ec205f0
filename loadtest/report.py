"""`python -m loadtest report RESULTS...`: metakv and etcd side by side, from the run folders
(and metakv through its etcd gateway, ``metakv-etcd``, when such runs are among them).

Every figure is computed from the files a run wrote (run.json, locust.json, checks.json,
samples.csv); nothing is typed in. Percentiles come from Locust's response-time histograms
(the same rounding Locust's own tables use); throughput is requests divided by the span
between the run's first and last request. The report is written twice: Markdown beside its
PNG plots, and one self-contained HTML page with the same plots inlined as base64.
"""

from __future__ import annotations

import base64
import csv
import datetime as dt
import html
import json
import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

from loadtest.scenario_names import SCENARIOS  # noqa: E402

TARGET_ORDER = ("metakv", "metakv-etcd", "etcd")
TARGET_COLORS = {"metakv": "#1f77b4", "metakv-etcd": "#2ca02c", "etcd": "#ff7f0e"}
# churn plot: one colour per operation, one line style and marker per target
TARGET_LINES = {"metakv": ("-", "o"), "metakv-etcd": (":", "^"), "etcd": ("--", "s")}
FAILOVER_BUCKET_S = 0.5  # latency-over-time resolution
# Statistics entries that are not client operations: the checks, the watch stream plumbing
# (a long poll's duration is mostly waiting), and redirect hops (counted with their write).
NOT_OPERATIONS_PREFIXES = ("check:",)
NOT_OPERATIONS = {"watch poll", "watch open", "watch delivery"}


@dataclass
class OperationStats:
    name: str
    requests: int
    failures: int
    histogram: dict[float, int]
    throughput_per_s: float

    @property
    def p50_ms(self) -> float:
        return percentile(self.histogram, 0.50)

    @property
    def p99_ms(self) -> float:
        return percentile(self.histogram, 0.99)


@dataclass
class Run:
    folder: Path
    meta: dict[str, Any]
    operations: dict[str, OperationStats]
    checks: dict[str, Any] | None
    span_s: float

    @property
    def target(self) -> str:
        """The cluster kind the runner started, or for a URL target the API it spoke."""
        target = self.meta.get("target")
        return str(target) if target in TARGET_ORDER else str(self.meta.get("store") or target)

    @property
    def scenario(self) -> str:
        return str(self.meta["scenario"])

    @property
    def churn(self) -> float:
        return float(self.meta.get("churn", 0.0))

    @property
    def failover(self) -> dict[str, Any] | None:
        return self.meta.get("failover")

    def client_operations(self) -> list[OperationStats]:
        return [op for name, op in self.operations.items() if is_operation(name)]

    def totals(self) -> OperationStats:
        merged: dict[float, int] = defaultdict(int)
        requests = failures = 0
        for op in self.client_operations():
            requests += op.requests
            failures += op.failures
            for bucket, count in op.histogram.items():
                merged[bucket] += count
        return OperationStats("all operations", requests, failures, dict(merged),
                              requests / self.span_s if self.span_s > 0 else 0.0)


@dataclass
class Report:
    runs: list[Run]
    blocks: list[tuple[str, Any]] = field(default_factory=list)  # ("h2"|"p"|"table"|"image", ...)


def is_operation(name: str) -> bool:
    return not name.startswith(NOT_OPERATIONS_PREFIXES) and name not in NOT_OPERATIONS and "(307" not in name


def percentile(histogram: dict[float, int], fraction: float) -> float:
    """Locust's own rule: the smallest recorded (rounded) time covering ``fraction`` of requests."""
    total = sum(histogram.values())
    if total == 0:
        return math.nan
    needed = fraction * total
    seen = 0
    for bucket in sorted(histogram):
        seen += histogram[bucket]
        if seen >= needed:
            return float(bucket)
    return float(max(histogram))


def find_run_folders(paths: Iterable[Path]) -> list[Path]:
    folders: list[Path] = []
    for path in paths:
        path = Path(path)
        if (path / "run.json").is_file():
            folders.append(path)
        elif path.is_dir():
            folders.extend(sorted(child for child in path.iterdir() if (child / "run.json").is_file()))
        else:
            raise FileNotFoundError(f"{path}: not a results folder (no run.json) nor a folder of them")
    if not folders:
        raise FileNotFoundError("no results folders (folders holding run.json) among " + ", ".join(map(str, paths)))
    return folders


def load_run(folder: Path) -> Run:
    meta = json.loads((folder / "run.json").read_text())
    entries = json.loads((folder / "locust.json").read_text())
    starts = [entry["start_time"] for entry in entries if entry["num_requests"] and is_operation(entry["name"])]
    ends = [entry["last_request_timestamp"] for entry in entries
            if entry["num_requests"] and is_operation(entry["name"]) and entry["last_request_timestamp"]]
    span_s = (max(ends) - min(starts)) if starts and ends else 0.0
    operations: dict[str, OperationStats] = {}
    for entry in entries:
        name = entry["name"]
        histogram = {float(bucket): int(count) for bucket, count in entry["response_times"].items()}
        previous = operations.get(name)
        if previous is not None:  # the same name under two methods: merge
            for bucket, count in previous.histogram.items():
                histogram[bucket] = histogram.get(bucket, 0) + count
        requests = entry["num_requests"] + (previous.requests if previous else 0)
        failures = entry["num_failures"] + (previous.failures if previous else 0)
        operations[name] = OperationStats(name, requests, failures, histogram,
                                          requests / span_s if span_s > 0 else 0.0)
    checks_path = folder / "checks.json"
    checks = json.loads(checks_path.read_text()) if checks_path.is_file() else None
    return Run(folder, meta, operations, checks, span_s)


def latest_per_key(runs: list[Run]) -> dict[tuple[str, float, str, bool], Run]:
    """(scenario, churn, target, failover) -> the most recent run of that kind."""
    chosen: dict[tuple[str, float, str, bool], Run] = {}
    for run in sorted(runs, key=lambda run: str(run.meta.get("started", ""))):
        chosen[(run.scenario, run.churn, run.target, run.failover is not None)] = run
    return chosen


def _fmt_ms(value: float) -> str:
    return "–" if math.isnan(value) else (f"{value:.0f}" if value >= 10 else f"{value:.1f}")


def _fmt_ratio(numerator: float, denominator: float) -> str:
    if denominator <= 0 or math.isnan(numerator) or math.isnan(denominator):
        return "–"
    return f"{numerator / denominator:.2f}×"


def _checks_text(run: Run | None) -> str:
    if run is None:
        return "–"
    if run.checks is None:
        return "no checks file"
    watch = run.checks.get("watch") or {}
    parts = ["ok" if run.checks.get("ok") else f"FAILED ({run.checks.get('failed_checks', '?')} problems)"]
    if watch.get("watchers"):
        parts.append(f"watch {watch['delivered']}/{watch['acked_writes']} delivered in order")
    cas = run.checks.get("cas")
    if cas:
        parts.append("CAS counters " + ("match wins" if cas["ok"] else "DO NOT match wins"))
    return "; ".join(parts)


def _scenario_order(scenario: str) -> int:
    names = list(SCENARIOS)
    return names.index(scenario) if scenario in names else len(names)


def build(runs: list[Run], out: Path) -> Report:
    report = Report(runs)
    steady = {key: run for key, run in latest_per_key(runs).items() if not key[3]}
    failovers = {key: run for key, run in latest_per_key(runs).items() if key[3]}
    hosts = sorted({str(run.meta.get("host")) for run in runs})
    report.blocks.append(("h1", "metakv vs etcd: metadata load test report"))
    report.blocks.append(("p", (
        f"Generated {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M UTC} from {len(runs)} runs on {', '.join(hosts)}. "
        "Both stores ran as 3-node clusters on loopback (metakv: 3 voters; etcd 3.4: 3 members, fsync on), "
        f"{_cluster_sharing(runs)}, driven by the same Locust scenarios through `loadtest/stores.py`. "
        "Latencies are client-side "
        "milliseconds; throughput is requests per second over the run. Ratios are metakv ÷ etcd "
        "(throughput: above 1 is better for metakv; p99: below 1 is better for metakv)."
        + (" metakv-etcd is a metakv cluster driven through its etcd v3 JSON gateway by the same etcd "
           "adapter that drives etcd; its ratios are to etcd too." if any(run.target == "metakv-etcd" for run in runs)
           else "")
    )))
    _headline(report, steady)
    _scenarios(report, steady, out)
    _churn(report, steady, out)
    _failover(report, failovers, out)
    _runs_table(report, runs)
    return report


def _cluster_sharing(runs: list[Run]) -> str:
    shared = sum(1 for run in runs if run.meta.get("cluster_shared"))
    if shared == 0:
        return "a fresh cluster for every run"
    return (f"{shared} of {len(runs)} runs on one cluster per target shared across runs (each run under its own "
            "key prefix), the others on a fresh cluster each")


def _headline(report: Report, steady: dict[tuple[str, float, str, bool], Run]) -> None:
    targets = [target for target in TARGET_ORDER if any(key[2] == target for key in steady)]
    compared = [target for target in targets if target != "etcd"] if "etcd" in targets else []
    rows = []
    groups = sorted({(key[0], key[1]) for key in steady}, key=lambda pair: (_scenario_order(pair[0]), pair[1]))
    for scenario, churn in groups:
        runs = {target: steady.get((scenario, churn, target, False)) for target in targets}
        totals = {target: run.totals() if run else None for target, run in runs.items()}
        label = f"{scenario} (churn {churn:g})" if scenario == "churn" else scenario
        rows.append([
            label,
            *(f"{total.throughput_per_s:.0f}" if total else "–" for total in totals.values()),
            *(_ratio_to_etcd(totals, target, lambda op: op.throughput_per_s) for target in compared),
            *(_fmt_ms(total.p99_ms) if total else "–" for total in totals.values()),
            *(_ratio_to_etcd(totals, target, lambda op: op.p99_ms) for target in compared),
            "/".join(str(total.failures) if total else "–" for total in totals.values()),
        ])
        if scenario == "watchers":
            watches = {target: run.operations.get("watch delivery") if run else None for target, run in runs.items()}
            rows.append([
                "watchers: write → event delivered", *([""] * (len(targets) + len(compared))),
                *(_fmt_ms(watch.p99_ms) if watch else "–" for watch in watches.values()),
                *(_ratio_to_etcd(watches, target, lambda op: op.p99_ms) for target in compared), "",
            ])
    report.blocks.append(("h2", "Headline: ratios to etcd, same scenario, same machine"))
    report.blocks.append(("table", (
        ["scenario", *(f"{target} ops/s" for target in targets),
         *(f"{target} ÷ etcd ops/s" for target in compared), *(f"{target} p99 ms" for target in targets),
         *(f"{target} ÷ etcd p99" for target in compared), f"failed requests ({'/'.join(targets)})"],
        rows,
    )))


def _ratio_to_etcd(figures: dict[str, OperationStats | None], target: str,
                   value_of: Callable[[OperationStats], float]) -> str:
    mine, etcd = figures.get(target), figures.get("etcd")
    return _fmt_ratio(value_of(mine), value_of(etcd)) if mine and etcd else "–"


def _scenarios(report: Report, steady: dict[tuple[str, float, str, bool], Run], out: Path) -> None:
    report.blocks.append(("h2", "Per operation"))
    groups = sorted({(key[0], key[1]) for key in steady}, key=lambda pair: (_scenario_order(pair[0]), pair[1]))
    for scenario, churn in groups:
        runs = {target: steady.get((scenario, churn, target, False)) for target in TARGET_ORDER}
        present = {target: run for target, run in runs.items() if run is not None}
        title = f"{scenario}, churn {churn:g}" if scenario == "churn" else scenario
        report.blocks.append(("h3", title))
        any_run = next(iter(present.values()))
        report.blocks.append(("p", (
            f"{any_run.meta.get('users')} users, rate {any_run.meta.get('rate') or 'closed loop'}, "
            f"{any_run.meta.get('duration'):g} s per target. Checks — "
            + "; ".join(f"{target}: {_checks_text(run)}" for target, run in present.items())
        )))
        names: list[str] = []
        for run in present.values():
            for name, op in run.operations.items():
                if (is_operation(name) or name == "watch delivery") and op.requests and name not in names:
                    names.append(name)
        rows = []
        for name in names:
            for target, run in present.items():
                op = run.operations.get(name)
                if op is None:
                    continue
                throughput = f"{op.throughput_per_s:.0f}" if name != "watch delivery" else "–"
                rows.append([name, target, str(op.requests), str(op.failures), _fmt_ms(op.p50_ms),
                             _fmt_ms(op.p99_ms), throughput])
        report.blocks.append(("table", (["operation", "target", "requests", "failed", "p50 ms", "p99 ms", "ops/s"],
                                        rows)))
        image = out / f"ops-{scenario}-c{churn:g}.png"
        _plot_operations(present, names, title, image)
        report.blocks.append(("image", image))


def _plot_operations(runs: dict[str, Run], names: list[str], title: str, path: Path) -> None:
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    width = 0.8 / max(1, len(runs))
    positions = range(len(names))
    for index, (target, run) in enumerate(runs.items()):
        offsets = [p + (index - (len(runs) - 1) / 2) * width for p in positions]
        ops = [run.operations.get(name) for name in names]
        for axis, value_of in zip(axes, (
            lambda op: op.p50_ms, lambda op: op.p99_ms,
            lambda op: op.throughput_per_s if op.name != "watch delivery" else 0.0,
        ), strict=True):
            values = [value_of(op) if op is not None else 0.0 for op in ops]
            axis.bar(offsets, [0.0 if math.isnan(v) else v for v in values], width,
                     label=target, color=TARGET_COLORS.get(target))
    for axis, label in zip(axes, ("p50 latency (ms)", "p99 latency (ms)", "throughput (ops/s)"), strict=True):
        axis.set_title(label, fontsize=10)
        axis.set_xticks(list(positions))
        axis.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        axis.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def _churn(report: Report, steady: dict[tuple[str, float, str, bool], Run], out: Path) -> None:
    levels = sorted({key[1] for key in steady if key[0] == "churn"})
    if len(levels) < 2:
        return
    report.blocks.append(("h2", "Latency and throughput against churn"))
    report.blocks.append(("p", (
        "The churn scenario at each churn level (share of operations that create or delete keys; the "
        "rest are updates and reads). One line per operation and target."
    )))
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    rows = []
    all_names = sorted({name for key, run in steady.items() if key[0] == "churn" for name in run.operations
                        if is_operation(name)})
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color_of = {name: palette[index % len(palette)] for index, name in enumerate(all_names)}
    for target in TARGET_ORDER:
        runs = [(level, steady.get(("churn", level, target, False))) for level in levels]
        runs = [(level, run) for level, run in runs if run is not None]
        if not runs:
            continue
        names = sorted({name for _, run in runs for name in run.operations if is_operation(name)})
        for name in names:
            points = [(level, run.operations[name]) for level, run in runs if name in run.operations]
            linestyle, marker = TARGET_LINES[target]
            style = {"linestyle": linestyle, "marker": marker, "color": color_of[name], "label": f"{target} {name}"}
            xs = [level for level, _ in points]
            axes[0].plot(xs, [op.p50_ms for _, op in points], **style)
            axes[1].plot(xs, [op.p99_ms for _, op in points], **style)
            axes[2].plot(xs, [op.throughput_per_s for _, op in points], **style)
        for level, run in runs:
            total = run.totals()
            rows.append([target, f"{level:g}", f"{total.throughput_per_s:.0f}", _fmt_ms(total.p50_ms),
                         _fmt_ms(total.p99_ms), str(total.failures)])
    for axis, label in zip(axes, ("p50 latency (ms)", "p99 latency (ms)", "throughput (ops/s)"), strict=True):
        axis.set_title(label, fontsize=10)
        axis.set_xlabel("churn (share of creates + deletes)")
        axis.grid(alpha=0.3)
    axes[2].legend(fontsize=6, ncol=2)
    figure.tight_layout()
    image = out / "churn-levels.png"
    figure.savefig(image, dpi=90)
    plt.close(figure)
    report.blocks.append(("table", (["target", "churn", "ops/s", "p50 ms", "p99 ms", "failed"], rows)))
    report.blocks.append(("image", image))


def read_samples(folder: Path) -> list[tuple[float, str, float, bool]]:
    rows = []
    with open(folder / "samples.csv", newline="") as handle:
        for row in csv.DictReader(handle):
            rows.append((float(row["start_time_s"]), row["name"], float(row["response_time_ms"]), row["ok"] == "1"))
    return rows


def failover_timeline(run: Run) -> dict[str, Any]:
    """Per FAILOVER_BUCKET_S: p50/p99 latency and successful/failed ops per second, plus the
    write outage: the longest stretch without a completed write, from the last write
    completed before the kill to the end of the run."""
    samples = [row for row in read_samples(run.folder) if is_operation(row[1])]
    origin = float(run.meta.get("load_started_at") or (min(row[0] for row in samples) if samples else 0.0))
    buckets: dict[int, list[tuple[float, bool]]] = defaultdict(list)
    for start_s, _, response_ms, ok in samples:
        buckets[int((start_s - origin) // FAILOVER_BUCKET_S)].append((response_ms, ok))
    times, p50, p99, ok_rate, failed_rate = [], [], [], [], []
    for bucket in sorted(buckets):
        values = sorted(ms for ms, ok in buckets[bucket] if ok)
        times.append(bucket * FAILOVER_BUCKET_S)
        p50.append(values[len(values) // 2] if values else math.nan)
        p99.append(values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)] if values else math.nan)
        ok_rate.append(sum(1 for _, ok in buckets[bucket] if ok) / FAILOVER_BUCKET_S)
        failed_rate.append(sum(1 for _, ok in buckets[bucket] if not ok) / FAILOVER_BUCKET_S)
    killed_at = float((run.failover or {}).get("killed_at", origin))
    write_names = {"put", "update", "create", "delete", "cas: won", "cas: lost race", "put 64KiB"}
    write_done = sorted(start_s + ms / 1000.0 for start_s, name, ms, ok in samples if ok and name in write_names)
    before = [t for t in write_done if t <= killed_at]
    after = [t for t in write_done if t > killed_at]
    # The longest pause between successful writes from the kill on: a store whose writes in
    # flight still complete right after the kill, then stall, is charged with the stall.
    marks = [before[-1] if before else killed_at] + after
    outage_s = max((later - earlier for earlier, later in zip(marks, marks[1:], strict=False)), default=math.nan)
    return {
        "times": times, "p50": p50, "p99": p99, "ok_rate": ok_rate, "failed_rate": failed_rate,
        "kill_s": killed_at - origin, "write_outage_s": outage_s,
        "failed": sum(1 for row in samples if not row[3]),
    }


def _failover(report: Report, failovers: dict[tuple[str, float, str, bool], Run], out: Path) -> None:
    if not failovers:
        return
    report.blocks.append(("h2", "Leader failover: latency over time"))
    report.blocks.append(("p", (
        "The runner SIGKILLed the current leader (metakv: the leading voter; etcd: the leader member) "
        "mid-run; clients move to the next endpoint on connection errors and pause 0.1 s after a failed "
        "request. Write outage = the longest time without a completed write, from the last write completed "
        "before the kill to the end of the run."
    )))
    by_scenario: dict[tuple[str, float], dict[str, Run]] = defaultdict(dict)
    for (scenario, churn, target, _), run in failovers.items():
        by_scenario[(scenario, churn)][target] = run
    rows = []
    for (scenario, churn), runs in sorted(by_scenario.items()):
        ordered = [(target, runs[target]) for target in TARGET_ORDER if target in runs]
        figure, axes = plt.subplots(2, len(ordered), figsize=(6.5 * len(ordered), 5.5), squeeze=False, sharex=True)
        for column, (target, run) in enumerate(ordered):
            timeline = failover_timeline(run)
            outage = timeline["write_outage_s"]
            outage_text = "no write completed after the kill" if math.isnan(outage) else f"{outage:.2f}"
            rows.append([scenario, target, f"{timeline['kill_s']:.1f}", outage_text,
                         str(timeline["failed"]), _checks_text(run)])
            latency, rate = axes[0][column], axes[1][column]
            latency.plot(timeline["times"], timeline["p50"], label="p50", color=TARGET_COLORS.get(target))
            latency.plot(timeline["times"], timeline["p99"], label="p99", color="#d62728", alpha=0.8)
            latency.set_yscale("log")
            latency.set_ylabel("latency (ms)")
            latency.set_title(f"{target}: {scenario}", fontsize=10)
            rate.plot(timeline["times"], timeline["ok_rate"], label="ok ops/s", color=TARGET_COLORS.get(target))
            rate.plot(timeline["times"], timeline["failed_rate"], label="failed ops/s", color="#d62728")
            rate.set_ylabel("ops/s")
            rate.set_xlabel(f"seconds since load start (bucket {FAILOVER_BUCKET_S:g} s)")
            for axis in (latency, rate):
                axis.axvline(timeline["kill_s"], color="black", linestyle=":", label="leader SIGKILL")
                axis.grid(alpha=0.3)
                axis.legend(fontsize=7)
        figure.tight_layout()
        image = out / f"failover-{scenario}-c{churn:g}.png"
        figure.savefig(image, dpi=90)
        plt.close(figure)
        report.blocks.append(("image", image))
    report.blocks.append(("table", (["scenario", "target", "kill at s", "write outage s", "failed requests",
                                     "checks"], rows)))


def _runs_table(report: Report, runs: list[Run]) -> None:
    report.blocks.append(("h2", "Runs"))
    rows = []
    for run in sorted(runs, key=lambda run: str(run.meta.get("started", ""))):
        meta = run.meta
        rows.append([run.folder.name, run.target, run.scenario, f"{run.churn:g}", str(meta.get("users")),
                     str(meta.get("rate")), f"{meta.get('duration'):g}", str(meta.get("started", ""))[:19],
                     "yes" if run.failover else "", _checks_text(run)])
    report.blocks.append(("table", (["folder", "target", "scenario", "churn", "users", "rate", "duration s",
                                     "started (UTC)", "failover", "checks"], rows)))


def render_markdown(report: Report, out: Path) -> str:
    lines: list[str] = []
    for kind, content in report.blocks:
        if kind in ("h1", "h2", "h3"):
            lines += ["#" * int(kind[1]) + " " + content, ""]
        elif kind == "p":
            lines += [content, ""]
        elif kind == "table":
            header, rows = content
            lines.append("| " + " | ".join(header) + " |")
            lines.append("|" + "|".join(" --- " for _ in header) + "|")
            lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
            lines.append("")
        elif kind == "image":
            lines += [f"![{Path(content).stem}]({Path(content).relative_to(out)})", ""]
    return "\n".join(lines)


def render_html(report: Report) -> str:
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>metakv vs etcd load test</title>",
        "<style>body{font-family:sans-serif;max-width:1200px;margin:2em auto;padding:0 1em}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;"
        "font-size:13px;text-align:right}td:first-child,th:first-child{text-align:left}"
        "img{max-width:100%}</style></head><body>",
    ]
    for kind, content in report.blocks:
        if kind in ("h1", "h2", "h3"):
            parts.append(f"<{kind}>{html.escape(content)}</{kind}>")
        elif kind == "p":
            parts.append(f"<p>{html.escape(content)}</p>")
        elif kind == "table":
            header, rows = content
            parts.append("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>")
            for row in rows:
                parts.append("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>")
            parts.append("</table>")
        elif kind == "image":
            data = base64.b64encode(Path(content).read_bytes()).decode()
            parts.append(f"<p><img alt='{html.escape(Path(content).stem)}' src='data:image/png;base64,{data}'></p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(paths: Iterable[Path], out: Path) -> list[Path]:
    """Build the report from run folders into ``out``: report.md, report.html, the PNGs,
    and summary.json (the headline figures, machine-readable)."""
    runs = [load_run(folder) for folder in find_run_folders(paths)]
    out.mkdir(parents=True, exist_ok=True)
    report = build(runs, out)
    markdown_path = out / "report.md"
    html_path = out / "report.html"
    markdown_path.write_text(render_markdown(report, out))
    html_path.write_text(render_html(report))
    summary_path = out / "summary.json"
    summary_path.write_text(json.dumps(_finite(summary(runs)), indent=2) + "\n")
    return [markdown_path, html_path, summary_path]


def _finite(value: Any) -> Any:
    """NaN (no successful request of a kind) becomes null: JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def summary(runs: list[Run]) -> list[dict[str, Any]]:
    """Per run: the totals and per-operation figures the report shows."""
    rows = []
    for run in runs:
        total = run.totals()
        rows.append({
            "folder": str(run.folder), "scenario": run.scenario, "target": run.target, "churn": run.churn,
            "failover": run.failover is not None, "throughput_per_s": total.throughput_per_s,
            "latency_ms_p50": total.p50_ms, "latency_ms_p99": total.p99_ms, "requests": total.requests,
            "failures": total.failures, "checks_ok": (run.checks or {}).get("ok"),
            "operations": {
                name: {"requests": op.requests, "failures": op.failures, "latency_ms_p50": op.p50_ms,
                       "latency_ms_p99": op.p99_ms, "throughput_per_s": op.throughput_per_s}
                for name, op in run.operations.items()
            },
        })
    return rows
