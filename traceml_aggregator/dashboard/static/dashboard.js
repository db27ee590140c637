// The TraceML dashboard page: frames from /api/events (server-sent events), drawn with uPlot.
// Frames are documented in traceml_aggregator/dashboard/frames.py; the first holds everything,
// the later ones only new points (and the tables whole). Each chart's element carries
// data-points, the points it draws (read by tests/test_dashboard.py).
"use strict";

const TOKEN = new URLSearchParams(location.search).get("token") || "";
const PHASES = [["input_wait", "input wait", "#e15759"], ["h2d", "H2D", "#f28e2b"],
  ["forward", "forward", "#4e79a7"], ["backward", "backward", "#76b7b2"],
  ["optimizer", "optimizer", "#59a14f"], ["residual", "residual", "#bab0ac"]];
const PALETTE = ["#4e79a7", "#e15759", "#59a14f", "#f28e2b", "#b07aa1", "#76b7b2", "#edc948",
  "#ff9da7", "#9c755f", "#bab0ac", "#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02"];
const MAX_LINES = PALETTE.length;   // ranks (the server sends at most 16) or nodes drawn as lines
const MAX_POINTS = 20000;           // points kept per series (every other one dropped beyond)
const MIB = 1024 * 1024;

const state = { steps: {}, phases: null, memory: {}, system: {}, seen: new Map(), charts: {}, frame: null };

function thinned(series, keys) {
  if (series[keys[0]].length <= MAX_POINTS) return;
  for (const k of keys) series[k] = series[k].filter((_, i) => i % 2 === 0);
}

// ``series`` (null: none yet) with the points of ``delta`` appended (replaced when it resets).
function extended(series, delta, keys) {
  if (!series || delta.reset) series = Object.fromEntries(keys.map(k => [k, []]));
  for (const k of keys) for (const v of (delta[k] || [])) series[k].push(v);
  thinned(series, keys);
  return series;
}

function absorb(store, delta, keys) {
  for (const [id, d] of Object.entries(delta)) store[id] = extended(store[id], d, keys);
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(c ?? ""));
  return e;
}

const fmt = (v, digits = 1) => (v === null || v === undefined) ? "–" : Number(v).toFixed(digits);
const mib = v => (v === null || v === undefined) ? "–" : (v / MIB).toFixed(0);

// One uPlot chart in element ``id``: x is time (s) when ``xTime``, else the step; ``percent``
// fixes the y range at 0-100.
function chart(id, xTime, labels, data, yLabel, percent) {
  const box = document.getElementById(id);
  let points = 0;
  for (let i = 1; i < data.length; i++) for (const v of data[i]) if (v !== null && v !== undefined) points++;
  box.dataset.points = String(points);
  box.dataset.series = String(labels.length);
  const key = labels.join("|");
  let c = state.charts[id];
  if (c && c.key !== key) { c.plot.destroy(); c = null; box.textContent = ""; }
  if (!labels.length || !data[0].length) {
    if (c) { c.plot.destroy(); delete state.charts[id]; }
    box.textContent = "no readings yet";
    return;
  }
  if (!c) {
    if (box.firstChild && !box.querySelector(".uplot")) box.textContent = "";
    const opts = {
      width: Math.max(300, box.clientWidth), height: 240,
      scales: { x: { time: xTime }, y: percent ? { range: [0, 100] } : {} },
      axes: [{ label: xTime ? "" : "step" }, { label: yLabel, size: 60 }],
      series: [{ label: xTime ? "time" : "step" }].concat(labels.map((l, i) => ({
        label: l.label, stroke: l.color || PALETTE[i % PALETTE.length], width: 1.5, spanGaps: true,
        points: { show: false },
      }))),
    };
    c = state.charts[id] = { key, plot: new uPlot(opts, data, box) };
  } else {
    c.plot.setData(data);
  }
}

function drawSteps(frame) {
  const ranks = frame.charted_ranks.filter(r => state.steps[r]);
  const tables = ranks.map(r => [state.steps[r].step, state.steps[r].step_ms]);
  const data = tables.length ? uPlot.join(tables) : [[]];
  chart("chart-steps", false, ranks.map(r => ({ label: "rank " + r })), data, "ms", false);
}

function drawPhases() {
  const data = [state.phases.step], labels = [];
  for (const [name, label, color] of PHASES) {
    if (state.phases[name].some(v => v)) { data.push(state.phases[name]); labels.push({ label, color }); }
  }
  chart("chart-phases", false, labels, labels.length ? data : [[]], "%", true);
}

function drawMemory(frame) {
  const tables = [], labels = [];
  for (const r of frame.charted_ranks) {
    const m = state.memory[r];
    if (!m || tables.length >= MAX_LINES) continue;
    if (m.rss_bytes.some(v => v !== null)) {
      tables.push([m.t, m.rss_bytes.map(v => v === null ? null : v / MIB)]);
      labels.push({ label: `rank ${r} RSS` });
    }
    if (m.gpu_allocated_bytes.some(v => v !== null)) {
      tables.push([m.t, m.gpu_allocated_bytes.map(v => v === null ? null : v / MIB)]);
      labels.push({ label: `rank ${r} GPU` });
    }
  }
  chart("chart-memory", true, labels, tables.length ? uPlot.join(tables) : [[]], "MiB", false);
}

function drawNodes(kind, id) {
  const tables = [], labels = [];
  for (const n of Object.keys(state.system).map(Number).sort((a, b) => a - b).slice(0, MAX_LINES)) {
    const s = state.system[n];
    if (s[kind].some(v => v !== null)) { tables.push([s.t, s[kind]]); labels.push({ label: "node " + n }); }
  }
  chart(id, true, labels, tables.length ? uPlot.join(tables) : [[]], "%", true);
}

function drawVerdict(frame) {
  const box = document.getElementById("verdict");
  const v = frame.verdict;
  box.textContent = "";
  if (!v) { box.append("no verdict yet (waiting for enough steps)"); box.className = "muted"; return; }
  box.className = "";
  box.dataset.kind = v.kind;
  box.append(el("span", { class: "badge " + v.severity }, v.severity), el("span", { class: "k" }, v.kind),
    v.ranks && v.ranks.length ? ` · ranks ${v.ranks.join(", ")}` : "",
    el("div", {}, v.summary), el("div", { class: "act" }, "Next: " + v.action));
}

function drawFindings(frame) {
  const list = document.getElementById("findings");
  const all = (frame.verdict ? [{ ...frame.verdict, section: "verdict" }] : []).concat(frame.findings);
  const now = new Date().toLocaleTimeString();
  list.textContent = "";
  if (!all.length) { list.append(el("li", { class: "muted" }, "none yet")); return; }
  for (const f of all) {
    const key = `${f.section}:${f.kind}:${(f.ranks || []).join(",")}`;
    const fresh = !state.seen.has(key);
    if (fresh) state.seen.set(key, now);
    list.append(el("li", { class: fresh ? "new" : "", "data-kind": f.kind },
      el("span", { class: "badge " + f.severity }, f.severity), el("span", { class: "k" }, f.kind),
      el("small", { class: "muted" }, ` (${f.section.replace("_", " ")}, seen ${state.seen.get(key)})`),
      el("br"), f.summary));
  }
}

function table(id, head, rows) {
  const t = document.getElementById(id);
  t.textContent = "";
  t.append(el("tr", {}, ...head.map(h => el("th", {}, h))));
  for (const r of rows) t.append(r);
}

function drawRanks(frame) {
  const flagged = new Set((frame.verdict && frame.verdict.ranks) || []);
  table("ranks", ["rank", "node", "host", "state", "steps", "since last step s", "step ms (median)",
    "p95 ms", "input %", "CPU %", "RSS MiB", "GPU MiB"], frame.ranks.map(r => {
    const stale = r.last_step_age_s !== null && r.last_step_age_s > 30 && r.state === "running";
    return el("tr", { "data-rank": r.rank, class: (flagged.has(r.rank) ? "flag " : "") + (stale ? "stale" : "") },
      el("td", {}, String(r.rank)), el("td", {}, r.node_rank ?? "–"), el("td", {}, r.hostname ?? "–"),
      el("td", {}, r.state), el("td", {}, String(r.steps)), el("td", {}, fmt(r.last_step_age_s)),
      el("td", {}, fmt(r.step_ms_median)), el("td", {}, fmt(r.step_ms_p95)), el("td", {}, fmt(r.input_pct)),
      el("td", {}, fmt(r.cpu_percent, 0)), el("td", {}, mib(r.rss_bytes)), el("td", {}, mib(r.gpu_allocated_bytes)));
  }));
}

function drawNodeTable(frame) {
  table("nodes", ["node", "host", "ranks", "state", "last seen s ago", "CPU %", "GPU util %", "GPUs"],
    frame.nodes.map(n => el("tr", { "data-node": n.node_rank, class: n.state === "silent" ? "stale" : "" },
      el("td", {}, String(n.node_rank)), el("td", {}, n.hostname ?? "–"), el("td", {}, n.ranks.join(", ")),
      el("td", {}, n.state), el("td", {}, fmt(n.last_seen_age_s)), el("td", {}, fmt(n.cpu_percent, 0)),
      el("td", {}, fmt(n.gpu_util_percent, 0)), el("td", {}, n.gpu_note))));
  const notes = frame.nodes.filter(n => n.gpu_util_percent === null).map(n => `node ${n.node_rank}: ${n.gpu_note}`);
  document.getElementById("gpu-note").textContent = notes.join("; ");
}

function draw(frame) {
  state.frame = frame;
  const run = frame.run;
  document.getElementById("run-name").textContent = run.run_name;
  document.getElementById("run-info").textContent =
    `${run.world_size} ranks · ${run.status} · ${run.live ? "live" : "stored run"} · updated ` +
    new Date(run.generated_unix_s * 1000).toLocaleTimeString();
  drawVerdict(frame); drawFindings(frame); drawRanks(frame); drawNodeTable(frame);
  drawSteps(frame); drawPhases(); drawMemory(frame);
  drawNodes("cpu_percent", "chart-cpu"); drawNodes("gpu_util_percent", "chart-gpu");
  document.body.dataset.frames = String(Number(document.body.dataset.frames || 0) + 1);
}

function onFrame(frame) {
  if (frame.full) { state.steps = {}; state.memory = {}; state.system = {}; state.phases = null; }
  absorb(state.steps, frame.steps, ["step", "step_ms"]);
  state.phases = extended(state.phases, frame.phases, ["step"].concat(PHASES.map(p => p[0])));
  absorb(state.memory, frame.memory, ["t", "rss_bytes", "gpu_allocated_bytes"]);
  absorb(state.system, frame.system, ["t", "cpu_percent", "gpu_util_percent"]);
  draw(frame);
}

const events = new EventSource("/api/events?token=" + encodeURIComponent(TOKEN));
events.onmessage = e => onFrame(JSON.parse(e.data));
events.onerror = () => {
  document.getElementById("run-info").textContent +=
    events.readyState === EventSource.CLOSED ? " · disconnected" : " · reconnecting…";
};
