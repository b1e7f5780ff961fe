// streamer dashboard: read-only, live over one websocket to the page's own host.
// URL parameters: api_key (lists sessions, watches any), session + token (a dashboard token
// watches that one session).
//
// First paint comes from one HTTP fetch (/dashboard/session.json, /dashboard/sessions.json),
// not from the websocket. Headless Chromium's --virtual-time-budget (screenshot and prerender
// jobs) advances the page's clock while nothing it counts as loading is pending; it counts
// fetches, not websocket messages, so a page that painted only from websocket events was
// captured before any reply came and showed dashes. And the cards fed by session.snapshot
// waited for the next snapshot, which the server pushes only when the session changes: an idle
// session never filled them. The fetch holds the virtual clock and fills every card at once.
"use strict";

const params = new URLSearchParams(location.search);
const apiKey = params.get("api_key");
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf"];
const NS = "http://www.w3.org/2000/svg";
let ws = null;
let watching = null;      // session id being watched
let watchToken = null;
let nextId = 1;
let dataVersion = null;   // the watched session's current data_version
const flash = new Map();  // flash_id -> latest flash entry (with history)
const actions = [];
const subscribeIds = new Set();  // event ids of our subscribe commands (their errors go to the panel)
let showClosed = false;   // closed sessions are folded into one "closed (N)" row until it is opened

const $ = (id) => document.getElementById(id);

function send(msg) {
  msg.event_id = "d" + nextId++;
  ws.send(JSON.stringify(msg));
  return msg.event_id;
}

function query(extra) {
  const q = new URLSearchParams(extra);
  if (apiKey) q.set("api_key", apiKey);
  return q.toString();
}

async function fetchJson(path, extra = {}) {
  const response = await fetch(`${path}?${query(extra)}`, { cache: "no-store" });
  const body = await response.json();
  if (!response.ok) throw body.error ?? { code: "http_" + response.status, message: response.statusText };
  return body;
}

async function firstPaint() {
  const sid = params.get("session");
  const list = fetchJson("/dashboard/sessions.json").then((body) => {
    renderList(body.sessions);
    $("worker").textContent = "worker " + body.worker;
  }, showListError);
  let one = Promise.resolve();
  if (sid) {
    openDetail(sid, params.get("token"));
    const extra = { session: sid };
    if (params.get("token")) extra.token = params.get("token");
    one = fetchJson("/dashboard/session.json", extra).then((body) => {
      if (body.session) renderState(body.session);
      if (body.snapshot) renderSnapshot(body.snapshot);
    }, showDetailError);
  }
  await Promise.all([list, one]);
}

function connect() {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  ws = new WebSocket(`${scheme}://${location.host}/${apiKey ? "?" + query({}) : ""}`);
  ws.onopen = () => {
    $("conn").textContent = "live";
    listSessions();
    if (watching) subscribe(watching, watchToken);
  };
  ws.onclose = () => {
    $("conn").textContent = "disconnected; retrying…";
    setTimeout(connect, 2000);
  };
  ws.onmessage = (msg) => handle(JSON.parse(msg.data));
}

function listSessions() {
  if (ws && ws.readyState === WebSocket.OPEN) send({ type: "sessions.list" });
}

function openDetail(sid, token) {
  watching = sid;
  watchToken = token;
  dataVersion = null;
  flash.clear();
  actions.length = 0;
  $("reasoning").textContent = "";
  $("actions").textContent = "";
  for (const id of ["lag", "cache", "version", "action-seq"]) $(id).textContent = "–";
  $("detail-error").hidden = true;
  $("detail").hidden = false;
  document.body.classList.add("watching");
  $("sid").textContent = sid;
  renderFlash();
  markSelected();
}

function subscribe(sid, token) {
  const msg = { type: "subscribe", session_id: sid };
  if (token) msg.token = token;
  subscribeIds.add(send(msg));
}

function watch(sid) {  // a click in the list (an operator: no token needed)
  if (watching === sid) return;
  if (watching && ws.readyState === WebSocket.OPEN) send({ type: "unsubscribe", session_id: watching });
  openDetail(sid, null);
  fetchJson("/dashboard/session.json", { session: sid }).then((body) => {
    if (watching !== sid) return;
    if (body.session) renderState(body.session);
    if (body.snapshot) renderSnapshot(body.snapshot);
  }, showDetailError);
  if (ws.readyState === WebSocket.OPEN) subscribe(sid, null);
}

function handle(ev) {
  if (ev.type === "error") return showError(ev);
  if (ev.session_id && ev.session_id !== watching && ev.type !== "sessions") return;
  switch (ev.type) {
    case "sessions": renderList(ev.sessions); $("worker").textContent = "worker " + ev.worker; break;
    case "subscribed": $("detail-error").hidden = true; renderState(ev.session); break;
    case "session.snapshot": renderSnapshot(ev.snapshot); break;
    case "flash.updated": updateFlash(ev); renderFlash(); break;
    case "flash.stale": markStale(ev); renderFlash(); break;
    case "reasoning.delta": appendReasoning(ev.delta); break;
    case "reasoning.done": endNote(ev); break;
    case "action.chunk": addAction(`#${ev.seq} chunk: ${(ev.actions || []).length} actions, t0 ${fmtTime(ev.t0)}`); break;
    case "action.command": addAction(`rule ${ev.rule_id} fired: ${JSON.stringify(ev.command)}` +
                                     (ev.media_s != null ? ` at ${fmtMediaTime(ev.media_s)}` : "")); break;
  }
}

function showError(ev) {
  const err = ev.error || {};
  if (subscribeIds.has(ev.reply_to)) {
    subscribeIds.delete(ev.reply_to);
    showDetailError(err);
  } else if (ev.session_id && ev.session_id === watching) {
    showDetailError(err);
  } else {
    showListError(err);
  }
}

function showListError(err) {
  $("list-note").textContent = err.code === "unauthorized"
    ? "The session list needs an API key (?api_key=…) on this server."
    : `${err.code}: ${err.message}`;
}

function showDetailError(err) {
  const box = $("detail-error");
  box.textContent = err.code === "session_not_found"
    ? `Cannot watch this session: ${err.message}. The token may be wrong, or the session closed.`
    : `${err.code}: ${err.message}`;
  box.hidden = false;
}

/** Live sessions first; closed ones (kept in the store until their retention ends) folded
 * under one "closed (N)" row that opens and folds them. */
function renderList(sessions) {
  const body = $("sessions");
  body.textContent = "";
  const open = sessions.filter((s) => !s.closed), closed = sessions.filter((s) => s.closed);
  for (const s of open) body.appendChild(sessionRow(s));
  if (closed.length) {
    const tr = document.createElement("tr");
    tr.className = "closed-toggle";
    const td = document.createElement("td");
    td.colSpan = 6;
    const button = document.createElement("button");
    button.type = "button";
    button.id = "closed-toggle";
    button.setAttribute("aria-expanded", String(showClosed));
    button.textContent = `${showClosed ? "▾" : "▸"} closed (${closed.length})`;
    button.onclick = () => { showClosed = !showClosed; renderList(sessions); };
    td.appendChild(button);
    tr.appendChild(td);
    body.appendChild(tr);
    for (const s of closed) {
      const row = sessionRow(s);
      row.hidden = !showClosed;
      body.appendChild(row);
    }
  }
  $("list-note").textContent = open.length ? "" : closed.length ? "No live sessions." : "No sessions yet.";
  markSelected();
}

function sessionRow(s) {
  const tr = document.createElement("tr");
  tr.className = s.closed ? "session closed" : "session";
  tr.dataset.sessionId = s.session_id;
  const stateText = s.closed ? "closed" : s.detached ? "detached" : s.ended ? "ended" : "live";
  const cells = [s.session_id, s.owner, fmtCount(s.tokens), s.data_version, fmtMs(s.ingest_lag_ms), stateText];
  cells.forEach((v, i) => {
    const td = document.createElement("td");
    td.textContent = v;
    if (i === 0) td.title = s.session_id;
    tr.appendChild(td);
  });
  if (!s.closed) tr.onclick = () => watch(s.session_id);
  return tr;
}

function markSelected() {
  for (const tr of document.querySelectorAll("tr.session")) {
    tr.classList.toggle("selected", tr.dataset.sessionId === watching);
  }
}

function cacheText(s) {  // a video session also shows the frames it has read
  return `${fmtCount(s.tokens)} tok / ${fmtBytes(s.cache_bytes)}` + (s.frames ? ` · ${fmtCount(s.frames)} frames` : "");
}

function renderState(st) {
  $("cache").textContent = cacheText(st);
  setVersion(st.data_version);
  for (const q of st.flash || []) flash.set(q.flash_id, { ...q, seenAt: Date.now() / 1000 });
  renderFlash();
}

function renderSnapshot(s) {
  $("lag").textContent = s.ingest_lag_ms == null ? "none yet" : fmtMs(s.ingest_lag_ms);
  $("cache").textContent = cacheText(s);
  setVersion(s.data_version);
  $("action-seq").textContent = s.last_action_seq ?? 0;
  for (const q of s.flash || []) flash.set(q.flash_id, { ...(flash.get(q.flash_id) || {}), ...q, seenAt: Date.now() / 1000 });
  if (s.reasoning && !$("reasoning").textContent) $("reasoning").textContent = s.reasoning;
  renderFlash();
}

function setVersion(v) {
  if (v == null) return;
  dataVersion = Math.max(dataVersion ?? v, v);
  $("version").textContent = dataVersion;
}

function updateFlash(ev) {
  const q = flash.get(ev.flash_id) || { flash_id: ev.flash_id, question: ev.question, history: [] };
  Object.assign(q, { answer: ev.answer, data_version: ev.data_version, media_s: ev.media_s, confidence: ev.confidence,
                     evaluated_at: ev.evaluated_at, stale: false, staleness: null });
  q.history = (q.history || []).concat([{ data_version: ev.data_version, logit_gap: ev.confidence.logit_gap,
                                          mean_prob: ev.confidence.mean_prob, at: ev.evaluated_at }]);
  flash.set(ev.flash_id, q);
  setVersion(ev.data_version);
}

function markStale(ev) {  // flash.stale: one question (flash_id) or all of the session's
  for (const [id, q] of flash) if (!ev.flash_id || ev.flash_id === id) q.stale = true;
}

/** {versions, seconds} behind for one flash entry, from the session's current version. */
function staleness(q) {
  if (q.data_version == null) return null;
  const versions = dataVersion == null ? (q.staleness?.versions ?? 0) : Math.max(0, dataVersion - q.data_version);
  const last = (q.history || []).at(-1);
  const at = q.evaluated_at ?? last?.at;
  const seconds = at != null ? Date.now() / 1000 - at
    : (q.staleness?.seconds ?? 0) + (Date.now() / 1000 - (q.seenAt ?? Date.now() / 1000));
  return { versions, seconds: Math.max(0, seconds) };
}

function renderFlash() {
  const body = $("flash");
  body.textContent = "";
  for (const q of flash.values()) {
    const tr = document.createElement("tr");
    tr.dataset.flashId = q.flash_id;
    const st = staleness(q);
    const behind = st && (st.versions > 0 || q.stale);
    tr.classList.toggle("stale", Boolean(behind));
    const conf = q.confidence ? `p ${Math.round(q.confidence.mean_prob * 100)}%, gap ${q.confidence.logit_gap.toFixed(1)}`
      : "–";
    const stText = !st ? "–" : q.stale ? `stale · ${fmtAge(st.seconds)}`
      : st.versions > 0 ? `${st.versions} behind · ${fmtAge(st.seconds)}` : `current · ${fmtAge(st.seconds)}`;
    const version = q.data_version == null ? "–"  // on video: and the media time of the newest frame it saw
      : `v${q.data_version}` + (q.media_s != null ? ` @ ${fmtMediaTime(q.media_s)}` : "");
    const cells = [q.flash_id, q.question, q.answer ?? "(not yet)", version,
                   stText, conf];
    cells.forEach((v, i) => {
      const td = document.createElement("td");
      if (i === 0) idText(td, v);
      else td.textContent = v;
      td.className = ["id", "question", "answer", "version", "staleness", "confidence"][i];
      tr.appendChild(td);
    });
    body.appendChild(tr);
  }
  renderChart();
}

/** A flash id in its cell: it may wrap after "-", "_" or "." (a <wbr> after each), never inside
 * a word; a piece too long for the column ends in an ellipsis (style.css), the whole id in the title. */
function idText(td, id) {
  td.title = id;
  for (const part of String(id).split(/(?<=[-_.])/)) td.append(part, document.createElement("wbr"));
}

function svg(tag, attrs, text) {
  const el = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text != null) el.textContent = text;
  return el;
}

/** Integer ticks between lo and hi, at most `most` of them. */
function ticks(lo, hi, most = 8) {
  const step = Math.max(1, Math.ceil((hi - lo) / (most - 1)));
  const out = [];
  for (let v = lo; v <= hi; v += step) out.push(v);
  return out;
}

function renderChart() {
  const chart = $("chart");
  chart.textContent = "";
  $("legend").textContent = "";
  const L = 54, R = 590, T = 10, B = 160;  // plot area in viewBox units (600 x 200)
  const series = [...flash.values()].map((q) => (q.history || []).filter((h) => h.mean_prob != null));
  const versions = series.flat().map((h) => h.data_version);
  const lo = versions.length ? Math.min(...versions) : 0;
  const hi = versions.length ? Math.max(...versions, lo + 1) : 1;
  const x = (v) => L + ((v - lo) / (hi - lo)) * (R - L);
  const y = (p) => B - p * (B - T);
  for (const p of [0, 0.25, 0.5, 0.75, 1]) {  // y axis: mean probability
    chart.appendChild(svg("line", { x1: L, x2: R, y1: y(p), y2: y(p), stroke: p === 0 ? "#889" : "#dde", "stroke-width": 1 }));
    chart.appendChild(svg("text", { x: L - 6, y: y(p) + 4, "text-anchor": "end", class: "tick y" }, p.toFixed(2)));
  }
  chart.appendChild(svg("line", { x1: L, x2: L, y1: T, y2: B, stroke: "#889", "stroke-width": 1 }));
  for (const v of ticks(lo, hi)) {  // x axis: data_version
    chart.appendChild(svg("line", { x1: x(v), x2: x(v), y1: B, y2: B + 4, stroke: "#889", "stroke-width": 1 }));
    chart.appendChild(svg("text", { x: x(v), y: B + 16, "text-anchor": "middle", class: "tick x" }, String(v)));
  }
  chart.appendChild(svg("text", { x: (L + R) / 2, y: 196, "text-anchor": "middle", class: "axis-label x" }, "data_version"));
  chart.appendChild(svg("text", { x: 12, y: (T + B) / 2, "text-anchor": "middle", class: "axis-label y",
                                  transform: `rotate(-90 12 ${(T + B) / 2})` }, "mean prob"));
  if (!versions.length) {
    chart.appendChild(svg("text", { x: (L + R) / 2, y: (T + B) / 2, "text-anchor": "middle", class: "empty" },
                          "no flash answers yet"));
    return;
  }
  [...flash.values()].forEach((q, i) => {
    const color = COLORS[i % COLORS.length];
    const pts = series[i].map((h) => `${x(h.data_version).toFixed(1)},${y(h.mean_prob).toFixed(1)}`);
    chart.appendChild(svg("polyline", { points: pts.join(" "), fill: "none", stroke: color, "stroke-width": 2 }));
    for (const h of series[i]) {
      chart.appendChild(svg("circle", { cx: x(h.data_version), cy: y(h.mean_prob), r: 3, fill: color }));
    }
    const item = document.createElement("span");
    item.className = "legend-item";
    item.style.color = color;
    item.textContent = `■ ${q.flash_id}`;
    $("legend").appendChild(item);
  });
}

let noteText = "";  // the note being written: its deltas so far

function appendReasoning(text) {
  noteText += text;
  const pre = $("reasoning");
  pre.textContent = (pre.textContent + text).slice(-4000);
  pre.scrollTop = pre.scrollHeight;
}

// A note equal to an earlier one is dropped by the server (reasoning.done `repeated`): take its
// text back off the panel, as later answers never read it either.
function endNote(ev) {
  const pre = $("reasoning");
  if (ev.repeated && noteText && pre.textContent.endsWith(noteText)) {
    pre.textContent = pre.textContent.slice(0, -noteText.length);
  } else {
    pre.textContent = (pre.textContent + "\n").slice(-4000);
  }
  noteText = "";
}

function addAction(text) {
  actions.unshift(text);
  actions.length = Math.min(actions.length, 50);
  const list = $("actions");
  list.textContent = "";
  for (const a of actions) {
    const li = document.createElement("li");
    li.textContent = a;
    list.appendChild(li);
  }
}

// Numbers with their units, rounded to what a reader uses (as on the /app page): "250 ms" (not
// "250.37 ms"), "1.4 s"; "980 B", "1.2 KiB"; counts with thousands separators.
function fmtBytes(n) {
  if (n == null) return "–";
  if (n < 1024) return Math.round(n) + " B";
  const units = ["KiB", "MiB", "GiB"];
  let v = n / 1024, i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return `${v.toFixed(v < 10 ? 1 : 0)} ${units[i]}`;
}

function fmtMs(ms) {
  if (ms == null || !Number.isFinite(Number(ms))) return "–";
  const n = Math.max(0, Number(ms));
  if (n < 1000) return `${Math.round(n)} ms`;
  if (n < 60_000) return `${(n / 1000).toFixed(n < 10_000 ? 1 : 0)} s`;
  return fmtAge(n / 1000);
}

function fmtCount(n) { return n == null ? "–" : Number(n).toLocaleString("en-US"); }

function fmtMediaTime(s) {  // a position in the media: "12.3 s", "2:05.0"
  if (s == null) return "–";
  if (s < 60) return `${Number(s).toFixed(1)} s`;
  return `${Math.floor(s / 60)}:${(s % 60).toFixed(1).padStart(4, "0")}`;
}

function fmtAge(s) {
  return s < 90 ? `${Math.round(s)} s` : s < 5400 ? `${Math.round(s / 60)} min` : `${(s / 3600).toFixed(1)} h`;
}

function fmtTime(t) {
  return t ? new Date(t * 1000).toISOString().slice(11, 23) : "–";
}

// The page paints first (fetch), then goes live (websocket); timers only refresh after that.
firstPaint().finally(() => {
  connect();
  setInterval(listSessions, 1000);
  setInterval(renderFlash, 1000);  // staleness seconds keep counting between events
});
