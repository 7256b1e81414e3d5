// relay operator page: polls /api/ui/state once a second and draws it. No framework, no CDN:
// the charts are uPlot's (uplot.min.js, vendored, served by the relay).
// The admin key, when the relay has one, is typed into the page and sent as a header; it is
// kept in this variable only (not in a URL, not in storage).
// Requests that generate nothing (GET /health, /v1/models, /props, tokenize...) come apart in
// the state and are left out of the counts, latency figures and charts unless asked for:
// the toggle, or /ui?all=1.
"use strict";

const POLL_MS = 1000;
const RECENT_MAX = 100;
let adminKey = null;
let timer = null;
let seen = new Set();
let lastState = null;
let showAll = new URLSearchParams(location.search).get("all") === "1";

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : String(c));
  return node;
}

function setStatus(text, bad) {
  const s = $("status");
  s.textContent = text;
  s.classList.toggle("bad", !!bad);
}

function fmt(v, digits) {
  if (v === null || v === undefined) return "–";
  return Number(v).toFixed(digits === undefined ? 0 : digits);
}

// A wall time as the page writes it: 24 h, its seconds left out where `seconds` is false.
function hms(ts, seconds = true) {
  const d = new Date(ts * 1000);
  return d.toLocaleTimeString([], {hour12: false, hour: "2-digit", minute: "2-digit",
                                   second: seconds ? "2-digit" : undefined});
}

// ---- what is shown ---------------------------------------------------------------------
$("showall").checked = showAll;
$("showall").addEventListener("change", () => {
  showAll = $("showall").checked;
  const url = new URL(location.href);
  if (showAll) url.searchParams.set("all", "1"); else url.searchParams.delete("all");
  history.replaceState(null, "", url);
  if (lastState) render(lastState);
});

// ---- key prompt ------------------------------------------------------------------------
function askKey(message) {
  stop();
  $("keyform").hidden = false;
  $("keymsg").textContent = message || "";
  $("adminkey").focus();
  setStatus("admin key required", true);
}

$("keyform").addEventListener("submit", (ev) => {
  ev.preventDefault();
  adminKey = $("adminkey").value.trim() || null;
  $("adminkey").value = "";
  $("keymsg").textContent = "checking…";
  poll();
});

// ---- polling ---------------------------------------------------------------------------
function stop() { if (timer !== null) { clearTimeout(timer); timer = null; } }
function schedule() { stop(); timer = setTimeout(poll, POLL_MS); }

async function poll() {
  const headers = {};
  if (adminKey) headers["Authorization"] = "Bearer " + adminKey;
  let resp;
  try {
    resp = await fetch("/api/ui/state", {headers, cache: "no-store"});
  } catch (e) {
    setStatus("relay unreachable; retrying", true);
    schedule();
    return;
  }
  if (resp.status === 401) {
    await resp.text();
    askKey(adminKey ? "admin key refused" : "");
    return;
  }
  if (resp.status === 403) {
    await resp.text();
    stop();
    setStatus("refused: this relay's admin page is open to its own machine only", true);
    return;
  }
  if (!resp.ok) {
    setStatus("relay answered " + resp.status + "; retrying", true);
    schedule();
    return;
  }
  const state = await resp.json();
  $("keyform").hidden = true;
  $("keymsg").textContent = "";
  render(state);
  setStatus("live · updated " + hms(state.now));
  schedule();
}

async function start() {
  try {
    const resp = await fetch("/ui/auth", {cache: "no-store"});
    const info = await resp.json();
    if (info.admin_key) { askKey(""); return; }
  } catch (e) { /* poll says what is wrong */ }
  poll();
}

// ---- drawing ---------------------------------------------------------------------------
function render(state) {
  lastState = state;
  renderUpstreams(state);
  renderCharts(state.trend, state.now);
  renderRecent(showAll ? merged(state.recent, state.recent_other) : state.recent);
  renderBudgets(state.budgets);
  renderPools(state.pools || []);
}

function merged(rows, other) {
  return rows.concat(other).sort((a, b) => b.ts - a.ts).slice(0, RECENT_MAX);
}

function fact(label, value, note) {
  const box = el("div", {class: "fact"}, el("span", {}, label), el("b", {}, value));
  if (note) box.append(el("small", {}, note));
  return box;
}

function renderUpstreams(state) {
  const box = $("upstreams");
  let hidden = 0;
  const cards = state.upstreams.map((u) => {
    const trips = u.stall_trips;
    const other = u.other_requests_total || 0;
    hidden += other;
    const card = el("div", {class: "card", "data-upstream": u.name},
      el("h3", {}, u.name, el("span", {class: "badge " + u.state, "data-role": "state"}, u.state)),
      el("div", {class: "facts"},
        fact("slots", `${u.in_flight} / ${u.parallel}`),
        fact("queue", u.queued),
        fact("tokens/s", fmt(u.tokens_per_sec, 1)),
        fact("TTFT avg", u.ttft_avg_seconds === null ? "–" : fmt(u.ttft_avg_seconds * 1000) + " ms"),
        el("div", {class: "fact", "data-role": "requests"},
           el("span", {}, "requests"), el("b", {}, showAll ? u.requests_total + other : u.requests_total),
           el("small", {}, [u.requests_failed ? `${u.requests_failed} failed` : "",
                            showAll && other ? `incl. ${other} generating nothing` : ""].filter(Boolean).join(" · "))),
        fact("stall trips", trips.total + trips.idle + trips.read,
             `total ${trips.total} · idle ${trips.idle} · read ${trips.read}`)));
    return card;
  });
  box.replaceChildren(...cards);
  $("hidden").textContent = !showAll && hidden
    ? `(not counted: ${hidden} ${hidden === 1 ? "request that generates" : "requests that generate"} nothing)` : "";
}

// ---- charts (uPlot) ----------------------------------------------------------------------
const COLORS = ["#2f6fdf", "#8e44ad", "#1a7f4b", "#b7791f", "#c0392b", "#16a085", "#d35400", "#34495e"];
// lines: [figure in the state, line label, dashed]; streamed: a figure of streams only (no
// series of requests that generate nothing)
const CHARTS = [
  {id: "ttft", title: "TTFT p50 / p99", unit: "ms", streamed: true,
   lines: [["ttft_p50", "p50", false], ["ttft_p99", "p99", true]]},
  {id: "tpot", title: "TPOT mean / ITL p99", unit: "ms", streamed: true,
   lines: [["tpot", "TPOT", false], ["itl_p99", "ITL p99", true]]},
  {id: "e2e", title: "E2E p50", unit: "ms", lines: [["e2e_p50", "", false]]},
  {id: "err", title: "Error rate", unit: "%", lines: [["err_pct", "", false]]},
  {id: "rps", title: "Completed requests", unit: "req/s", lines: [["req_s", "", false]]},
  {id: "tps", title: "Output tokens", unit: "tok/s", lines: [["tok_s", "", false]]},
];
const CHART_H = 190;
// id -> {key, box, sizer, options (a width -> uPlot's options), data, u (null until sized)}
const charts = new Map();
let xRange = [0, 1];

// A chart is made, and sized again, at the width its card has once laid out: this observer
// watches a strip of no height at the top of each card (as wide as the card's content, and
// nothing the chart draws changes its size), and its first report makes the chart. It reports
// again when the window is resized or the grid changes its columns.
const sizes = new ResizeObserver((entries) => {
  for (const entry of entries) {
    const c = charts.get(entry.target.parentElement.dataset.chart);
    const width = Math.floor(entry.contentRect.width);
    if (!c || c.sizer !== entry.target || width <= 0) continue;
    if (!c.u) c.u = new uPlot(c.options(width), c.data, c.box);
    else if (width !== c.u.width) c.u.setSize({width, height: CHART_H});
  }
});

function seriesName(s) {
  return `${s.upstream} · ${s.model ?? "–"}` + (s.generating ? "" : " (generates nothing)");
}

function minutes(seconds) {
  return seconds % 60 ? `${seconds} s` : `${seconds / 60} min`;
}

function dropChart(c) {
  sizes.unobserve(c.sizer);
  if (c.u) c.u.destroy();
  c.u = null;
}

function renderCharts(trend, now) {
  const area = $("charts");
  const shown = trend.series.filter((s) => showAll || s.generating);
  const span = minutes(trend.window_s);
  $("window").textContent = `(last ${span}, a point per ${trend.step_s} s` +
    (trend.untracked ? `; ${trend.untracked} requests of further series not charted)` : ")");
  if (!shown.length || !trend.times.length) {
    for (const c of charts.values()) dropChart(c);
    charts.clear();
    area.replaceChildren(el("p", {class: "empty"}, `no requests in the last ${span}`));
    return;
  }
  if (!charts.size) area.replaceChildren();
  xRange = [now - trend.window_s, now];
  const all = shown.map((s, i) => ({s, name: seriesName(s), color: COLORS[i % COLORS.length]}));
  for (const spec of CHARTS) {
    const lines = spec.streamed ? all.filter((x) => x.s.generating) : all;
    const data = [trend.times];
    for (const {s} of lines) for (const [fig] of spec.lines) data.push(s[fig]);
    const key = lines.map((x) => x.name + x.color).join("\n");
    let c = charts.get(spec.id);
    if (c && c.key !== key) { dropChart(c); charts.delete(spec.id); c = null; }
    if (!c) {
      let box = area.querySelector(`[data-chart="${spec.id}"]`);
      if (!box) { box = el("div", {class: "chart", "data-chart": spec.id}); area.append(box); }
      let sizer = box.querySelector(".sizer");
      if (!sizer) { sizer = el("div", {class: "sizer"}); box.prepend(sizer); }
      c = {key, box, sizer, data, u: null, options: (width) => chartOptions(spec, lines, span, width)};
      charts.set(spec.id, c);
      // Observed anew, the strip is reported at its present width: a chart made again (other
      // series) in a card already laid out is made too.
      sizes.observe(sizer);
    } else {
      c.data = data;
      if (c.u) c.u.setData(data);
    }
    let points = 0;
    for (let i = 1; i < data.length; i++) for (const v of data[i]) if (v !== null) points++;
    c.box.dataset.points = points;
  }
}

// The points drawn where there is no room to draw them all (uPlot's `points.show`): those with
// no value on either side, which no line segment shows. A step in which nothing settled has no
// latency or error rate (null in the state): that one step is a gap, and the line stops at it
// (`spanGaps: false`); requests/s and tokens/s are 0 then, a value.
function lonePoints(u, si, show) {
  if (show) return null;
  const ys = u.data[si];
  const lone = [];
  for (let i = 0; i < ys.length; i++) {
    if (ys[i] != null && ys[i - 1] == null && ys[i + 1] == null) lone.push(i);
  }
  return lone.length ? lone : null;
}

function chartOptions(spec, lines, span, width) {
  // The legend shows the values under the cursor, and nothing where there is none (no cursor,
  // or nothing measured in that step).
  const series = [{value: (u, ts, si, idx) => idx == null ? "" : hms(ts)}];
  lines.forEach(({name, color}) => {
    for (const [, label, dashed] of spec.lines) {
      series.push({
        label: label ? `${name} ${label}` : name,
        stroke: color,
        width: 1.6,
        dash: dashed ? [6, 4] : undefined,
        spanGaps: false,
        points: {size: 6, width: 1, fill: color, filter: lonePoints},
        value: (u, v) => v === null || v === undefined ? "" : `${+v.toFixed(2)} ${spec.unit}`,
      });
    }
  });
  return {
    title: `${spec.title} (${spec.unit}), last ${span}`,
    width,
    height: CHART_H,
    scales: {
      x: {time: true, auto: false, range: () => xRange},
      y: {range: (u, lo, hi) => [0, hi > 0 ? hi * 1.1 : 1]},
    },
    // The time axis in the table's times, with seconds where its ticks are not whole minutes
    // apart (uPlot's own labels put a date under the first).
    axes: [{space: 70, values: (u, splits, ai, space, incr) => splits.map((ts) => hms(ts, incr % 60 !== 0))},
           {label: spec.unit, size: 56, labelSize: 18}],
    series,
    legend: {live: true},
  };
}

// ---- tables ------------------------------------------------------------------------------
function renderRecent(rows) {
  const body = $("recent").tBodies[0];
  $("recentcount").textContent = rows.length ? `(last ${rows.length})` : "";
  if (!rows.length) {
    body.replaceChildren(el("tr", {}, el("td", {colspan: 11, class: "empty"}, "no requests yet")));
    return;
  }
  const fresh = new Set();
  body.replaceChildren(...rows.map((r) => {
    const tr = el("tr", {"data-request-id": r.request_id},
      el("td", {}, hms(r.ts)), el("td", {}, r.key || "–"), el("td", {}, r.model || "–"),
      el("td", {}, r.upstream || "–"),
      el("td", {class: "path", title: `${r.method} ${r.path}`}, `${r.method || "–"} ${r.path || ""}`),
      el("td", {class: "num"}, r.status ?? "–"),
      el("td", {class: "num"}, fmt(r.ttft_ms)), el("td", {class: "num"}, fmt(r.e2e_ms)),
      el("td", {class: "num"}, fmt(r.tokens_per_s, 1)),
      el("td", {class: "num"}, r.tokens ?? "–"),
      el("td", {class: r.ok ? "ok" : "bad"}, r.outcome || "–"));
    if (seen.size && !seen.has(r.request_id)) tr.className = "fresh";
    fresh.add(r.request_id);
    return tr;
  }));
  seen = fresh;
}

function usage(used, limit) {
  const cell = el("td", {}, limit ? `${used} / ${limit}` : `${used} (no limit)`);
  if (limit) {
    const share = Math.min(1, used / limit);
    const fill = el("i", {class: share >= 1 ? "full" : share >= 0.8 ? "high" : ""});
    fill.style.width = (share * 100).toFixed(1) + "%";
    cell.append(el("span", {class: "bar"}, fill));
  }
  return cell;
}

// One row per key and window; a key's name and its requests in flight and queued now span its
// rows (a key without limits: one row).
function renderBudgets(keys) {
  const body = $("budgets").tBodies[0];
  const rows = [];
  for (const k of keys) {
    const span = {rowspan: Math.max(1, k.windows.length)};
    const lead = [el("td", span, k.key),
                  el("td", {...span, class: "num", "data-role": "in-flight"}, k.in_flight),
                  el("td", {...span, class: "num", "data-role": "queued"}, k.queued)];
    if (!k.windows.length) {
      rows.push(el("tr", {"data-key": k.key}, ...lead,
                   el("td", {colspan: 3, class: "empty"}, "no limits")));
    }
    k.windows.forEach((w, i) => {
      rows.push(el("tr", {"data-key": k.key}, ...(i ? [] : lead), el("td", {}, w.window),
                   usage(w.requests, w.requests_limit), usage(w.tokens, w.tokens_limit)));
    });
  }
  if (!rows.length) rows.push(el("tr", {}, el("td", {colspan: 6, class: "empty"}, "no API keys configured")));
  body.replaceChildren(...rows);
}

// One row per pool: its members, its queue now, and its prompt-cache hit ratio.
function renderPools(pools) {
  const rows = pools.map((p) => el("tr", {"data-pool": p.pool},
    el("td", {}, p.pool), el("td", {}, p.members.join(", ")),
    el("td", {class: "num", "data-role": "waiting"}, p.waiting),
    el("td", {class: "num"}, p.prompt_tokens), el("td", {class: "num"}, p.cached_tokens),
    el("td", {class: "num", "data-role": "hit-ratio"},
       p.hit_ratio === null ? "" : (100 * p.hit_ratio).toFixed(1) + " %")));
  if (!rows.length) rows.push(el("tr", {}, el("td", {colspan: 6, class: "empty"}, "no pool served yet")));
  $("pools").tBodies[0].replaceChildren(...rows);
}

start();
