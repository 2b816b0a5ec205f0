// The cluster view: polls /ui/api/cluster (one snapshot per second, shared by every tab on
// this node) and the node's own metrics for the charts. Polls, not streams: a browser holds
// at most six HTTP/1.1 connections to a host, so streaming tabs would starve the others.
// A hidden tab does not poll; it catches up the moment it is shown.
"use strict";

(() => {
  const {api, el, ago, showError, problem} = metakv;
  const POLL_MS = 1000, METRICS_MS = 2000;
  let highestEpoch = -1;

  function cell(value) {
    return el("td", {}, value === null || value === undefined ? "–" : value);
  }

  function render(view) {
    // Never step back to an older epoch's leader (a late answer after a failover). A view
    // naming no leader is always shown: ignoring it once froze the page on a dead leader.
    if (view.leader_id >= 0 && view.epoch < highestEpoch) return;
    highestEpoch = Math.max(highestEpoch, view.epoch);
    const leader = document.getElementById("leader");
    const leaderRow = view.nodes.find((node) => node.node_id === view.leader_id);
    leader.dataset.leaderId = view.leader_id >= 0 ? String(view.leader_id) : "";
    leader.textContent = view.leader_id < 0 ? "none known"
      : `node ${view.leader_id}${leaderRow && !leaderRow.up ? " (down: not answering)" : ""}`;
    document.getElementById("epoch").textContent = view.epoch < 0 ? "–" : String(view.epoch);
    document.getElementById("high-watermark").textContent = view.high_watermark ?? "–";
    document.getElementById("fault-tolerance").textContent = view.can_lose === null
      ? "unknown without the leader's quorum view (it names the voters and who is caught up); " +
        `${view.nodes.filter((node) => node.up).length} node(s) known here answer`
      : `can lose ${view.can_lose} voter${view.can_lose === 1 ? "" : "s"} ` +
        `(${view.healthy_voters} of ${view.voters} healthy, majority ${view.majority})`;
    document.getElementById("taken").textContent = new Date(view.taken_ms).toLocaleTimeString();

    const banner = document.getElementById("quorum-banner");
    let message = "", level = "warning";
    if (view.leader_id < 0 || (leaderRow && !leaderRow.up)) {
      message = "No leader: writes and leader reads are unavailable until an election completes.";
      level = "danger";
    } else if (view.can_lose !== null && view.healthy_voters < view.majority) {
      message = `Quorum lost: ${view.healthy_voters} of ${view.voters} voters healthy, ${view.majority} needed.`;
      level = "danger";
    } else if (view.can_lose === 0) {
      message = "Quorum at risk: losing one more voter stops writes.";
    }
    banner.textContent = message;
    banner.className = `banner ${level}`;
    banner.hidden = !message;

    const rows = view.nodes.map((node) => {
      const row = el("tr", {dataset: {nodeId: String(node.node_id), role: node.role}, className: node.up ? "" : "down"},
        cell(`${node.node_id}${node.node_id === view.node_id ? " (this node)" : ""}`),
        cell(node.kind), el("td", {className: "role"}, node.role),
        cell(node.log_end_offset), cell(node.lag), cell(ago(node.last_caught_up_timestamp_ms, view.taken_ms)),
        cell(node.applied_version), cell(node.snapshot_id ? node.snapshot_id.end_offset : (node.up ? "none" : null)),
        cell(node.dirty_offset), cell(node.cleaned_end),
        cell(node.log_size_bytes === null || node.log_size_bytes === undefined ? null
          : `${(node.log_size_bytes / 1048576).toFixed(1)} MiB`),
        el("td", {}, node.url ? el("a", {href: `${node.url}/ui`}, node.url) : "–"));
      return row;
    });
    document.querySelector("#nodes tbody").replaceChildren(...rows);
  }

  async function poll() {
    if (document.hidden) return;
    try {
      const response = await api("/ui/api/cluster");
      if (response.ok) {
        render(await response.json());
        showError("");
      } else if (response.status !== 401) {
        showError(await problem(response));
      }
    } catch (error) {
      showError(`this node does not answer (${error.message}); retrying`);
    }
  }

  async function pollMetrics() {
    if (document.hidden) return;
    try {
      const response = await api("/ui/api/metrics");
      if (response.ok) {
        const {points} = await response.json();
        const series = (name) => points.map((p) => ({t: p.t, value: p.gap ? null : p[name]}));
        lineChart.draw(document.getElementById("chart-writes"), series("writes_per_s"));
        lineChart.draw(document.getElementById("chart-latency"), series("commit_latency_ms"));
        lineChart.draw(document.getElementById("chart-lag"), series("apply_lag"));
      }
    } catch (error) {
      // the cluster poll reports an unreachable node
    }
  }

  // Each poll waits for the previous one, so a slow node never has requests piling up.
  async function every(intervalMs, task) {
    for (;;) {
      await task();
      await new Promise((resolve) => setTimeout(resolve, intervalMs));
    }
  }

  metakv.whenReady(() => {
    every(POLL_MS, poll);
    every(METRICS_MS, pollMetrics);
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden) {
        poll();
        pollMetrics();
      }
    });
  });
})();
