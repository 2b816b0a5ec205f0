"""What the dashboard costs the node it watches: page load time and node CPU with the cluster
view open in many tabs, against the same node with none.

    python -m loadtest.bench_ui [--tabs 20] [--duration-s 20] [--loads 5] [--json PATH]

Starts a fresh 3-voter cluster and drives Debian's chromium (``/usr/bin/chromium``, through
playwright) at node 1. Phases, in this order, in one run:
- **no tabs**: the CPU seconds node 1 (and its two peers) use over ``--duration-s``, and the
  load time of the cluster view in a single fresh tab (navigation until the node table is
  filled), median of ``--loads`` loads;
- **N tabs**: ``--tabs`` tabs on /ui stay open, each polling once a second; the same CPU
  measure, and the load time of one more fresh tab while they poll.
CPU is read from /proc/PID/stat (user + system). Only the ratios (N tabs ÷ none) are
meaningful: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtest.local_cluster import Cluster

CHROMIUM = "/usr/bin/chromium"
FILLED_TABLE = "#nodes tbody tr"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def cpu_over(cluster: Cluster, duration_s: float) -> dict[int, float]:
    """Each node's CPU use over ``duration_s``, as a fraction of one core."""
    pids = {node_id: node.pid for node_id, node in cluster.nodes.items() if node.pid is not None}
    before = {node_id: cpu_seconds(pid) for node_id, pid in pids.items()}
    time.sleep(duration_s)
    return {node_id: (cpu_seconds(pid) - before[node_id]) / duration_s for node_id, pid in pids.items()}


def load_time_s(context: Any, url: str) -> float:
    page = context.new_page()
    try:
        started_s = time.perf_counter()
        page.goto(url)
        page.wait_for_selector(FILLED_TABLE)
        return time.perf_counter() - started_s
    finally:
        page.close()


def median_load_s(context: Any, url: str, loads: int) -> float:
    return statistics.median(load_time_s(context, url) for _ in range(loads))


def run(tabs: int, duration_s: float, loads: int) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="bench-ui-") as root, Cluster(Path(root), voters=3) as cluster, \
            sync_playwright() as playwright:
        cluster.wait_for_leader()
        node = cluster.nodes[1]
        url = f"{node.url}/ui"
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            context = browser.new_context()
            load_time_s(context, url)  # warm-up: the first load compiles templates and caches assets
            idle_load_s = median_load_s(context, url, loads)
            idle_cpu = cpu_over(cluster, duration_s)
            pages = []
            for _ in range(tabs):
                page = context.new_page()
                page.goto(url)
                pages.append(page)
            for page in pages:
                page.wait_for_selector(FILLED_TABLE)
            busy_load_s = median_load_s(context, url, loads)
            busy_cpu = cpu_over(cluster, duration_s)
        finally:
            browser.close()
    peers = [node_id for node_id in idle_cpu if node_id != 1]
    return {
        "tabs": tabs, "duration_s": duration_s, "loads": loads,
        "load_s": {"no_tabs": idle_load_s, "with_tabs": busy_load_s, "ratio": busy_load_s / idle_load_s},
        "node_cpu_cores": {"no_tabs": idle_cpu[1], "with_tabs": busy_cpu[1],
                           "ratio": busy_cpu[1] / max(idle_cpu[1], 1e-9)},
        "peer_cpu_cores": {"no_tabs": statistics.mean(idle_cpu[i] for i in peers),
                           "with_tabs": statistics.mean(busy_cpu[i] for i in peers)},
        "load_average": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tabs", type=int, default=20)
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--loads", type=int, default=5, help="fresh-tab loads per phase (median)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    results = run(args.tabs, args.duration_s, args.loads)
    print(json.dumps(results, indent=1), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
