// A tiny line chart drawn as SVG elements (no library, no inline style): points are
// {t, value}; null values and gaps break the line.
"use strict";

const lineChart = (() => {
  const NS = "http://www.w3.org/2000/svg";
  const WIDTH = 300, HEIGHT = 90, LEFT = 34, BOTTOM = 14, TOP = 6;

  function svgEl(tag, attributes, text) {
    const node = document.createElementNS(NS, tag);
    for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, String(value));
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function format(value) {
    if (value >= 100) return value.toFixed(0);
    if (value >= 10) return value.toFixed(1);
    return value.toFixed(2);
  }

  function draw(svg, points) {
    svg.replaceChildren();
    const measured = points.filter((p) => p.value !== null && p.value !== undefined);
    if (points.length < 2) {
      svg.append(svgEl("text", {x: LEFT, y: HEIGHT / 2, class: "chart-empty"}, "collecting…"));
      return;
    }
    const t0 = points[0].t, t1 = points[points.length - 1].t;
    const top = Math.max(1e-9, ...measured.map((p) => p.value));
    const x = (t) => LEFT + ((t - t0) / Math.max(1, t1 - t0)) * (WIDTH - LEFT - 2);
    const y = (v) => HEIGHT - BOTTOM - (v / top) * (HEIGHT - BOTTOM - TOP);
    svg.append(svgEl("line", {x1: LEFT, y1: HEIGHT - BOTTOM, x2: WIDTH, y2: HEIGHT - BOTTOM, class: "chart-axis"}));
    svg.append(svgEl("text", {x: 2, y: TOP + 8, class: "chart-label"}, format(top)));
    svg.append(svgEl("text", {x: 2, y: HEIGHT - BOTTOM, class: "chart-label"}, "0"));
    svg.append(svgEl("text", {x: LEFT, y: HEIGHT - 2, class: "chart-label"},
                     `${Math.round((t1 - t0) / 1000)} s`));
    let run = [];
    const flush = () => {
      if (run.length > 1) svg.append(svgEl("polyline", {points: run.join(" "), class: "chart-line"}));
      run = [];
    };
    for (const point of points) {
      if (point.value === null || point.value === undefined) {
        flush();
        continue;
      }
      run.push(`${x(point.t).toFixed(1)},${y(point.value).toFixed(1)}`);
    }
    flush();
    // "now" is the latest interval's value: none measured (no commit in it) is "–", not the
    // last value measured minutes ago.
    const latest = points[points.length - 1].value;
    svg.append(svgEl("text", {x: WIDTH - 60, y: TOP + 8, class: "chart-label"},
                     `now ${latest === null || latest === undefined ? "–" : format(latest)}`));
  }

  return {draw};
})();
