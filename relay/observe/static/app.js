// relay operator page: polls /api/ui/state once a second and draws it. No framework, no CDN.
// The admin key, when the relay has one, is typed into the page and sent as a header; it is
// kept in this variable only (not in a URL, not in storage).
"use strict";

const POLL_MS = 1000;
const SVG = "http://www.w3.org/2000/svg";
let adminKey = null;
let timer = null;
let seen = new Set();

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

function hms(ts) {
  const d = new Date(ts * 1000);
  return d.toLocaleTimeString([], {hour12: false});
}

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
  renderUpstreams(state);
  renderRecent(state.recent);
  renderBudgets(state.budgets);
}

function fact(label, value, note) {
  const box = el("div", {class: "fact"}, el("span", {}, label), el("b", {}, value));
  if (note) box.append(el("small", {}, note));
  return box;
}

function chart(kind, label, unit, points, index, span, now, digits) {
  const w = 300, h = 46, pad = 2;
  const values = points.filter((p) => p[index] !== null);
  const last = values.length ? values[values.length - 1][index] : null;
  const box = el("div", {class: "chart " + kind},
    el("div", {class: "label"}, el("span", {}, label),
       el("span", {}, last === null ? "–" : fmt(last, digits) + " " + unit)));
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.setAttribute("preserveAspectRatio", "none");
  if (values.length < 2) {
    const t = document.createElementNS(SVG, "text");
    t.setAttribute("x", 6); t.setAttribute("y", 28);
    t.textContent = "collecting…";
    svg.append(t);
  } else {
    const max = Math.max(...values.map((p) => p[index])) || 1;
    const x = (t) => pad + (w - 2 * pad) * Math.max(0, 1 - (now - t) / span);
    const y = (v) => h - pad - (h - 2 * pad) * (v / max);
    const pts = values.map((p) => `${x(p[0]).toFixed(1)},${y(p[index]).toFixed(1)}`);
    const area = document.createElementNS(SVG, "polygon");
    area.setAttribute("points", `${x(values[0][0]).toFixed(1)},${h} ${pts.join(" ")} ` +
                      `${x(values[values.length - 1][0]).toFixed(1)},${h}`);
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("points", pts.join(" "));
    line.setAttribute("vector-effect", "non-scaling-stroke");
    svg.append(area, line);
    box.firstChild.lastChild.append(el("span", {class: "peak"}, " · max " + fmt(max, digits)));
  }
  box.append(svg);
  return box;
}

function renderUpstreams(state) {
  const box = $("upstreams");
  const span = state.step_s * 72;
  const cards = state.upstreams.map((u) => {
    const trips = u.stall_trips;
    const card = el("div", {class: "card", "data-upstream": u.name},
      el("h3", {}, u.name, el("span", {class: "badge " + u.state, "data-role": "state"}, u.state)),
      el("div", {class: "facts"},
        fact("slots", `${u.in_flight} / ${u.parallel}`),
        fact("queue", u.queued),
        fact("tokens/s", fmt(u.tokens_per_sec, 1)),
        fact("TTFT avg", u.ttft_avg_seconds === null ? "–" : fmt(u.ttft_avg_seconds * 1000) + " ms"),
        fact("requests", u.requests_total, u.requests_failed ? `${u.requests_failed} failed` : ""),
        fact("stall trips", trips.total + trips.idle + trips.read,
             `total ${trips.total} · idle ${trips.idle} · read ${trips.read}`)),
      chart("tps", "tokens/s, last 6 min", "tok/s", u.trend, 1, span, state.now, 1),
      chart("ttft", "TTFT (mean of the last minute), last 6 min", "ms", u.trend, 2, span, state.now, 0));
    return card;
  });
  box.replaceChildren(...cards);
}

function renderRecent(rows) {
  const body = $("recent").tBodies[0];
  $("recentcount").textContent = rows.length ? `(last ${rows.length})` : "";
  if (!rows.length) {
    body.replaceChildren(el("tr", {}, el("td", {colspan: 9, class: "empty"}, "no requests yet")));
    return;
  }
  const fresh = new Set();
  body.replaceChildren(...rows.map((r) => {
    const tr = el("tr", {"data-request-id": r.request_id},
      el("td", {}, hms(r.ts)), el("td", {}, r.key || "–"), el("td", {}, r.model || "–"),
      el("td", {}, r.upstream || "–"), el("td", {class: "num"}, r.status ?? "–"),
      el("td", {class: "num"}, fmt(r.ttft_ms)), el("td", {class: "num"}, fmt(r.tokens_per_s, 1)),
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

function renderBudgets(keys) {
  const body = $("budgets").tBodies[0];
  const rows = [];
  for (const k of keys) {
    if (!k.windows.length) {
      rows.push(el("tr", {"data-key": k.key}, el("td", {}, k.key),
                   el("td", {colspan: 3, class: "empty"}, "no limits")));
    }
    for (const w of k.windows) {
      rows.push(el("tr", {"data-key": k.key}, el("td", {}, k.key), el("td", {}, w.window),
                   usage(w.requests, w.requests_limit), usage(w.tokens, w.tokens_limit)));
    }
  }
  if (!rows.length) rows.push(el("tr", {}, el("td", {colspan: 4, class: "empty"}, "no API keys configured")));
  body.replaceChildren(...rows);
}

start();
