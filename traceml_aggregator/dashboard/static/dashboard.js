// The TraceML dashboard page: frames from /api/events (server-sent events), drawn with uPlot.
// Frames are documented in traceml_aggregator/dashboard/frames.py; the first holds everything,
// the later ones only new points (and the tables whole). Each chart's element carries
// data-points, the points it draws, and data-labels, its series (read by the tests). Above
// the server's scale threshold (a frame with "scale"), the heatmap, the band and the sorted,
// searchable table replace the per-rank lines; document.body.dataset.drawMs holds the last
// frames' costs, "script/painted" ms each (read by benchmarks/dashboard.py --browser).
"use strict";

const TOKEN = new URLSearchParams(location.search).get("token") || "";
const PHASES = [["input_wait", "input wait", "#e15759"], ["h2d", "H2D", "#f28e2b"],
  ["forward", "forward", "#4e79a7"], ["backward", "backward", "#76b7b2"],
  ["optimizer", "optimizer", "#59a14f"], ["comm", "communication", "#edc948"],
  ["residual", "residual", "#bab0ac"]];  // traceml/core/phases.py's PARTS (a test checks)
const PALETTE = ["#4e79a7", "#e15759", "#59a14f", "#f28e2b", "#b07aa1", "#76b7b2", "#edc948",
  "#ff9da7", "#9c755f", "#bab0ac", "#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02"];
const MAX_LINES = PALETTE.length;   // ranks (the server sends at most 16) or nodes drawn as lines
const MAX_POINTS = 20000;           // points kept per series (every other one dropped beyond)
const MIB = 1024 * 1024;
const TABLE_ROWS = 50;              // rows of the ranks' table at scale (the search finds any rank)
const HEAT_MAX_ROWS = 512;          // pixel rows of the heatmap (each the slowest of its ranks)
const HEAT_MARGIN = 74;             // px left of the heatmap, for the slowest ranks' labels
// The ranks' table at scale is sorted by the figure the verdict is about (else step time).
const SORT_BY = {
  INPUT_STRAGGLER: ["input_pct", "input %"], INPUT_BOUND: ["input_pct", "input %"],
  H2D_STRAGGLER: ["h2d_pct", "H2D %"], H2D_BOUND: ["h2d_pct", "H2D %"],
  RANK_HUNG: ["last_step_age_s", "seconds since the last step"],
  MEMORY_CREEP: ["gpu_allocated_bytes", "GPU memory"], MEMORY_PRESSURE: ["gpu_allocated_bytes", "GPU memory"],
  MEMORY_IMBALANCE: ["gpu_allocated_bytes", "GPU memory"], HOST_MEMORY_CREEP: ["rss_bytes", "RSS"],
};
const STEP_SORT = ["step_ms_median", "step ms (median)"];

const state = { steps: {}, phases: null, memory: {}, system: {}, seen: new Map(), charts: {}, frame: null,
  metric: "step", cells: null, drawMs: [] };

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
// fixes the y range at 0-100; ``bands``: uPlot's (a fill between two series).
function chart(id, xTime, labels, data, yLabel, percent, bands) {
  const box = document.getElementById(id);
  let points = 0;
  for (let i = 1; i < data.length; i++) for (const v of data[i]) if (v !== null && v !== undefined) points++;
  box.dataset.points = String(points);
  box.dataset.series = String(labels.length);
  box.dataset.labels = labels.map(l => l.label).join("|");
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
        label: l.label, stroke: l.color || PALETTE[i % PALETTE.length], width: l.width || 1.5, spanGaps: true,
        points: { show: false }, dash: l.dash,
      }))),
      bands: bands || [],
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

const esc = v => String(v ?? "").replace(/[&<>"]/g, c => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);

// One table row as HTML: its attributes and its cells' texts (escaped here).
function tr(attrs, cells) {
  return `<tr${Object.entries(attrs).map(([k, v]) => ` ${k}="${esc(v)}"`).join("")}>` +
    cells.map(c => `<td>${esc(c)}</td>`).join("") + "</tr>";
}

// Table ``id`` with the header ``head`` and the rows of ``tr``: one assignment of HTML (a
// thousand rows of elements made one by one cost tens of ms a frame).
function table(id, head, rows) {
  document.getElementById(id).innerHTML = `<tr>${head.map(h => `<th>${esc(h)}</th>`).join("")}</tr>` + rows.join("");
}

// The ranks' rows to list, and the top ones to mark: all of them below the scale threshold
// (none marked); above, sorted by what the verdict is about (the top k marked, k being the
// slowest ranks' count), those the search box matches, at most TABLE_ROWS.
function listedRanks(frame) {
  const info = document.getElementById("ranks-info");
  if (!frame.scale) { info.textContent = ""; return { rows: frame.ranks, top: new Set() }; }
  const [key, label] = SORT_BY[frame.verdict && frame.verdict.kind] || STEP_SORT;
  const value = r => (r[key] === null || r[key] === undefined) ? -Infinity : r[key];
  const sorted = frame.ranks.slice().sort((a, b) => value(b) - value(a) || a.rank - b.rank);
  const q = document.getElementById("rank-search").value.trim().toLowerCase();
  let shown = sorted, what = `sorted by ${label}${frame.verdict ? ` (verdict: ${frame.verdict.kind})` : ""}, highest first`;
  if (q) {
    // "737": that rank; "node 92": that node's ranks; else the hosts whose name holds it
    const node = /^node\s*(\d+)$/.exec(q), rank = /^\d+$/.test(q);
    shown = sorted.filter(r => rank ? String(r.rank) === q : node ? r.node_rank === Number(node[1])
      : (r.hostname || "").toLowerCase().includes(q));
    what = `${shown.length} matching "${q}"`;
  }
  info.textContent = `${Math.min(shown.length, TABLE_ROWS)} of ${frame.ranks.length} shown · ${what}`;
  return { rows: shown.slice(0, TABLE_ROWS), top: new Set(sorted.slice(0, frame.scale.slowest.length).map(r => r.rank)) };
}

function drawRanks(frame) {
  const flagged = new Set((frame.verdict && frame.verdict.ranks) || []);
  const { rows, top } = listedRanks(frame);
  table("ranks", ["rank", "node", "host", "state", "steps", "since last step s", "step ms (median)",
    "p95 ms", "input %", "H2D %", "CPU %", "RSS MiB", "GPU MiB"], rows.map(r => {
    const stale = r.last_step_age_s !== null && r.last_step_age_s > 30 && r.state === "running";
    return tr({ "data-rank": r.rank,
      class: (flagged.has(r.rank) ? "flag " : "") + (top.has(r.rank) ? "top " : "") + (stale ? "stale" : "") },
      [r.rank, r.node_rank ?? "–", r.hostname ?? "–", r.state, r.steps, fmt(r.last_step_age_s), fmt(r.step_ms_median),
        fmt(r.step_ms_p95), fmt(r.input_pct), fmt(r.h2d_pct), fmt(r.cpu_percent, 0), mib(r.rss_bytes),
        mib(r.gpu_allocated_bytes)]);
  }));
}

// "0–7" for consecutive ranks, else "0, 2, 5".
function rankList(ranks) {
  const run = ranks.length > 2 && ranks[ranks.length - 1] - ranks[0] === ranks.length - 1;
  return run ? `${ranks[0]}–${ranks[ranks.length - 1]}` : ranks.join(", ");
}

function drawNodeTable(frame) {
  const slowest = new Map();  // node -> its rank of the highest step median
  for (const r of frame.ranks) {
    const s = slowest.get(r.node_rank);
    if (r.step_ms_median !== null && (!s || r.step_ms_median > s.step_ms_median)) slowest.set(r.node_rank, r);
  }
  table("nodes", ["node", "host", "ranks", "state", "last seen s ago", "CPU %", "GPU util %", "GPUs",
    "slowest rank", "its step ms"],
    frame.nodes.map(n => {
      const s = slowest.get(n.node_rank);
      return tr({ "data-node": n.node_rank, class: n.state === "silent" ? "stale" : "" },
        [n.node_rank, n.hostname ?? "–", rankList(n.ranks), n.state, fmt(n.last_seen_age_s), fmt(n.cpu_percent, 0),
          fmt(n.gpu_util_percent, 0), n.gpu_note, s ? s.rank : "–", fmt(s && s.step_ms_median)]);
    }));
  const byNote = new Map();  // one line per note: "nodes 0–127: no GPU readings"
  for (const n of frame.nodes.filter(n => n.gpu_util_percent === null)) {
    if (!byNote.has(n.gpu_note)) byNote.set(n.gpu_note, []);
    byNote.get(n.gpu_note).push(n.node_rank);
  }
  document.getElementById("gpu-note").textContent = [...byNote.entries()]
    .map(([note, nodes]) => `node${nodes.length > 1 ? "s" : ""} ${rankList(nodes)}: ${note}`).join("; ");
}

// The colour of each level 0..levels of a scale (0: no step), from its stops.
function palette(scale) {
  const rgb = h => [1, 3, 5].map(i => parseInt(h.slice(i, i + 2), 16));
  const stops = scale.colors.map(rgb), out = [rgb(scale.no_data_color)];
  for (let l = 1; l <= scale.levels; l++) {
    const x = (l - 1) / (scale.levels - 1) * (stops.length - 1), i = Math.min(stops.length - 2, Math.floor(x));
    out.push(stops[i].map((c, j) => Math.round(c + (stops[i + 1][j] - c) * (x - i))));
  }
  return out;
}

// The heatmap's rows: each rank, or each node (its slowest rank's level at each column).
function heatRows(scale) {
  if (document.getElementById("heat-rows").value !== "nodes") {
    return scale.ranks.map((r, i) => ({ label: "rank " + r, members: [i] }));
  }
  const byNode = new Map();
  scale.nodes.forEach((n, i) => { if (!byNode.has(n)) byNode.set(n, []); byNode.get(n).push(i); });
  return [...byNode.entries()].sort((a, b) => (a[0] ?? -1) - (b[0] ?? -1))
    .map(([n, members]) => ({ label: "node " + (n ?? "?"), members }));
}

function drawHeatmap(frame) {
  const s = frame.scale, canvas = document.getElementById("heat-canvas");
  const cells = state.cells, rows = heatRows(s), cols = s.columns;
  // The width is read once (and after a resize): reading it after the tables changed would
  // lay the whole page out again, every frame.
  if (!state.heatWidth) state.heatWidth = Math.max(400, document.getElementById("heatmap").clientWidth);
  const width = state.heatWidth, plotW = width - HEAT_MARGIN - 8;
  const plotH = Math.max(120, Math.min(HEAT_MAX_ROWS, rows.length * 4, Math.max(rows.length, 240)));
  if (canvas.width !== width || canvas.height !== plotH + 24) { canvas.width = width; canvas.height = plotH + 24; }
  const ctx = canvas.getContext("2d");
  if (state.colorsFor !== s.colors.join()) { state.colors = palette(s); state.colorsFor = s.colors.join(); }
  const colors = state.colors;
  ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, canvas.width, canvas.height);
  // One image pixel per column and per pixel row, each pixel row the slowest of its rows.
  const img = new ImageData(Math.max(1, cols), plotH), px = img.data;
  const members = rows.map(r => r.members);
  for (let y = 0; y < plotH; y++) {
    const first = Math.floor(y * rows.length / plotH), last = Math.max(first + 1, Math.floor((y + 1) * rows.length / plotH));
    for (let c = 0; c < cols; c++) {
      let level = 0;
      for (let k = first; k < last; k++) {
        const m = members[k];
        for (let j = 0; j < m.length; j++) { const v = cells[m[j] * cols + c]; if (v > level) level = v; }
      }
      const rgb = colors[level], o = (y * cols + c) * 4;
      px[o] = rgb[0]; px[o + 1] = rgb[1]; px[o + 2] = rgb[2]; px[o + 3] = 255;
    }
  }
  if (!state.heatImage) state.heatImage = document.createElement("canvas");
  const off = state.heatImage;
  if (off.width !== img.width || off.height !== plotH) { off.width = img.width; off.height = plotH; }
  off.getContext("2d").putImageData(img, 0, 0);
  ctx.imageSmoothingEnabled = false;
  ctx.drawImage(off, HEAT_MARGIN, 0, plotW, plotH);
  // Labels: the slowest ranks (or their nodes) at their rows; steps below.
  ctx.font = "11px system-ui, sans-serif"; ctx.fillStyle = "#222"; ctx.textBaseline = "middle";
  const rowOf = new Map(); rows.forEach((r, k) => r.members.forEach(i => rowOf.set(s.ranks[i], k)));
  const labelled = [], placed = [];  // the slowest first; a label that would overlap one placed is left out
  for (const rank of s.slowest) {
    const k = rowOf.get(rank), y = (k + 0.5) * plotH / rows.length;
    if (labelled.includes(rows[k].label) || placed.some(p => Math.abs(y - p) < 11)) continue;
    labelled.push(rows[k].label); placed.push(y);
    ctx.fillText(rows[k].label + " ▸", 2, y);
  }
  ctx.textBaseline = "top";
  const steps = s.band.step;
  for (let t = 0; t <= 4 && cols; t++) {
    const c = Math.min(cols - 1, Math.round(t * (cols - 1) / 4));
    ctx.fillText("step " + steps[c], HEAT_MARGIN + Math.min(plotW - 60, c * plotW / cols), plotH + 6);
  }
  Object.assign(canvas.dataset, { rows: String(rows.length), labels: labelled.join("|"),
    plot: [HEAT_MARGIN, 0, plotW, plotH].join(",") });
  canvas.onmousemove = e => {
    const r = canvas.getBoundingClientRect(), x = e.clientX - r.left - HEAT_MARGIN, y = e.clientY - r.top;
    if (x < 0 || y < 0 || x >= plotW || y >= plotH) return;
    const k = Math.floor(y * rows.length / plotH), c = Math.floor(x * cols / plotW);
    const level = Math.max(...rows[k].members.map(i => cells[i * cols + c]));
    const ms = level ? s.lo_ms + (level - 1) / (s.levels - 1) * (s.hi_ms - s.lo_ms) : null;
    document.getElementById("heat-tip").textContent = `${rows[k].label} · steps ${steps[c]}–${steps[c] + s.bin_steps - 1}` +
      (ms === null ? " · no step" : ` · ≈ ${ms.toFixed(1)} ms${level === s.levels ? " or more" : ""}`);
  };
  document.getElementById("heat-info").textContent =
    `${s.metric === "step" ? "step time" : s.metric} (ms, mean of ${s.bin_steps} step${s.bin_steps > 1 ? "s" : ""} a column), ` +
    `${s.ranks.length} ranks; labelled: the ${s.slowest.length} slowest`;
  const legend = document.getElementById("heat-legend");
  legend.textContent = "";
  legend.append(`${fmt(s.lo_ms)} ms`, el("span", { class: "ramp", style: `background: linear-gradient(to right, ${s.colors.join(", ")})` }),
    `${fmt(s.hi_ms)} ms or more`);
}

function drawBand(frame) {
  const s = frame.scale, b = s.band;
  const labels = [{ label: "min", color: "#9aa3ad", width: 1 }, { label: "median", color: "#1f2a36", width: 2 },
    { label: "max", color: "#9aa3ad", width: 1 }];
  const data = [b.step, b.min, b.median, b.max];
  s.slowest.forEach((r, i) => { labels.push({ label: "rank " + r, color: PALETTE[(i + 1) % PALETTE.length] }); data.push(s.lines[r]); });
  chart("chart-band", false, labels, b.step.length ? data : [[]], "ms", false,
    [{ series: [3, 1], fill: "rgba(78,121,167,0.15)" }]);
  document.getElementById("band-info").textContent =
    `${s.metric === "step" ? "step time" : s.metric}, ms: min, median and max over the ranks, and the ${s.slowest.length} slowest ranks`;
}

function drawScale(frame) {
  const on = !!frame.scale;
  for (const e of document.querySelectorAll(".scale")) if (e.hidden === on) e.hidden = !on;
  for (const e of document.querySelectorAll(".small-run")) if (e.hidden !== on) e.hidden = on;
  if (!on) return;
  const select = document.getElementById("metric");
  if (select.options.length !== frame.metrics.length) {
    select.textContent = "";
    for (const m of frame.metrics) select.append(el("option", { value: m }, m === "step" ? "step time" : m));
  }
  select.value = frame.scale.metric;
  drawBand(frame); drawHeatmap(frame);
}

// The charts first, then the text and the tables: a chart reads the page's layout, and each
// read after a change of the page would lay it all out again.
function draw(frame) {
  state.frame = frame;
  drawScale(frame);
  if (!frame.scale) drawSteps(frame);
  drawPhases(); drawMemory(frame);
  drawNodes("cpu_percent", "chart-cpu"); drawNodes("gpu_util_percent", "chart-gpu");
  const run = frame.run;
  document.getElementById("run-name").textContent = run.run_name;
  document.getElementById("run-info").textContent =
    `${run.world_size} ranks · ${run.status} · ${run.live ? "live" : "stored run"} · updated ` +
    new Date(run.generated_unix_s * 1000).toLocaleTimeString();
  drawVerdict(frame); drawFindings(frame); drawRanks(frame); drawNodeTable(frame);
  document.body.dataset.frames = String(Number(document.body.dataset.frames || 0) + 1);
}

// Base64 of one byte a cell to bytes.
function decodeCells(b64) {
  const bin = atob(b64), out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

function onFrame(frame) {
  if (frame.full) { state.steps = {}; state.memory = {}; state.system = {}; state.phases = null; }
  state.cells = frame.scale ? decodeCells(frame.scale.cells) : null;
  absorb(state.steps, frame.steps, ["step", "step_ms"]);
  state.phases = extended(state.phases, frame.phases, ["step"].concat(PHASES.map(p => p[0])));
  absorb(state.memory, frame.memory, ["t", "rss_bytes", "gpu_allocated_bytes"]);
  absorb(state.system, frame.system, ["t", "cpu_percent", "gpu_util_percent"]);
  draw(frame);
}

// Each frame's cost, ms (the last 20 kept): its script (parse and draw), and from its message
// to the page painted with it (layout and paint included).
function timed(message) {
  const t0 = performance.now();
  onFrame(JSON.parse(message.data));
  const script = performance.now() - t0;
  requestAnimationFrame(() => setTimeout(() => {
    state.drawMs.push([script, performance.now() - t0].map(v => v.toFixed(1)).join("/"));
    state.drawMs = state.drawMs.slice(-20);
    document.body.dataset.drawMs = state.drawMs.join(",");
  }, 0));
}

// The event stream, its scale views of ``state.metric`` (a new figure: a new stream, whose
// first frame holds everything).
let events = null;
function connect() {
  if (events) events.close();
  const figure = state.metric === "step" ? "" : `&metric=${encodeURIComponent(state.metric)}`;  // step: the server's default
  const source = events = new EventSource(`/api/events?token=${encodeURIComponent(TOKEN)}${figure}`);
  source.onmessage = timed;
  source.onerror = () => {
    document.getElementById("run-info").textContent +=
      source.readyState === EventSource.CLOSED ? " · disconnected" : " · reconnecting…";
  };
}
document.getElementById("metric").onchange = e => { state.metric = e.target.value; connect(); };
document.getElementById("heat-rows").onchange = () => state.frame && drawHeatmap(state.frame);
window.addEventListener("resize", () => { state.heatWidth = 0; if (state.frame && state.frame.scale) drawHeatmap(state.frame); });
document.getElementById("rank-search").oninput = () => state.frame && drawRanks(state.frame);
connect();
