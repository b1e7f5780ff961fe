// streamer dashboard: read-only, live over one websocket to the page's own host.
// URL parameters: api_key (lists sessions, watches any), session + token (a dashboard token
// watches that one session).
"use strict";

const params = new URLSearchParams(location.search);
const apiKey = params.get("api_key");
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf"];
let ws = null;
let watching = null;      // session id being watched
let nextId = 1;
const flash = new Map();  // flash_id -> latest flash entry (with history)
const actions = [];

const $ = (id) => document.getElementById(id);

function send(msg) {
  msg.event_id = "d" + nextId++;
  ws.send(JSON.stringify(msg));
}

function connect() {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const query = apiKey ? "?api_key=" + encodeURIComponent(apiKey) : "";
  ws = new WebSocket(`${scheme}://${location.host}/${query}`);
  ws.onopen = () => {
    $("conn").textContent = "live";
    listSessions();
    if (params.get("session")) watch(params.get("session"), params.get("token"));
  };
  ws.onclose = () => {
    $("conn").textContent = "disconnected; retrying…";
    const again = watching;
    watching = null;
    setTimeout(() => { connect(); if (again && !params.get("session")) watch(again, null); }, 2000);
  };
  ws.onmessage = (msg) => handle(JSON.parse(msg.data));
}

function listSessions() {
  if (ws && ws.readyState === WebSocket.OPEN) send({ type: "sessions.list" });
}

function watch(sid, token) {
  if (watching === sid) return;
  if (watching) send({ type: "unsubscribe", session_id: watching });
  watching = sid;
  flash.clear();
  actions.length = 0;
  $("reasoning").textContent = "";
  $("actions").textContent = "";
  $("detail").hidden = false;
  $("sid").textContent = sid;
  const msg = { type: "subscribe", session_id: sid };
  if (token) msg.token = token;
  send(msg);
  markSelected();
}

function handle(ev) {
  if (ev.session_id && ev.session_id !== watching && ev.type !== "sessions" && ev.type !== "error") return;
  switch (ev.type) {
    case "sessions": renderList(ev.sessions); $("worker").textContent = "worker " + ev.worker; break;
    case "subscribed": renderState(ev.session); break;
    case "session.snapshot": renderSnapshot(ev.snapshot); break;
    case "flash.updated": updateFlash(ev); renderFlash(); break;
    case "reasoning.delta": appendReasoning(ev.delta); break;
    case "reasoning.done": appendReasoning("\n"); break;
    case "action.chunk": addAction(`#${ev.seq} chunk: ${(ev.actions || []).length} actions, t0 ${fmtTime(ev.t0)}`); break;
    case "action.command": addAction(`rule ${ev.rule_id} fired: ${JSON.stringify(ev.command)}`); break;
    case "error": showError(ev); break;
  }
}

function showError(ev) {
  const err = ev.error || {};
  if (err.code === "unauthorized") {
    $("list-note").textContent = "The session list needs an API key (?api_key=…) on this server.";
  } else {
    $("list-note").textContent = `${err.code}: ${err.message}`;
  }
}

function renderList(sessions) {
  const body = $("sessions");
  body.textContent = "";
  for (const s of sessions) {
    const tr = document.createElement("tr");
    tr.className = "session";
    tr.dataset.sessionId = s.session_id;
    const stateText = s.closed ? "closed" : s.detached ? "detached" : s.ended ? "ended" : "live";
    for (const v of [s.session_id, s.owner, s.tokens, s.data_version, s.ingest_lag_ms ?? "–", stateText]) {
      const td = document.createElement("td");
      td.textContent = v;
      tr.appendChild(td);
    }
    if (!s.closed) tr.onclick = () => watch(s.session_id, null);
    body.appendChild(tr);
  }
  $("list-note").textContent = sessions.length ? "" : "No sessions yet.";
  markSelected();
}

function markSelected() {
  for (const tr of document.querySelectorAll("tr.session")) {
    tr.classList.toggle("selected", tr.dataset.sessionId === watching);
  }
}

function renderState(st) {
  $("cache").textContent = `${st.tokens} tok / ${fmtBytes(st.cache_bytes)}`;
  $("version").textContent = st.data_version;
  for (const q of st.flash || []) flash.set(q.flash_id, q);
  renderFlash();
}

function renderSnapshot(s) {
  $("lag").textContent = s.ingest_lag_ms == null ? "–" : `${s.ingest_lag_ms} ms`;
  $("cache").textContent = `${s.tokens} tok / ${fmtBytes(s.cache_bytes)}`;
  $("version").textContent = s.data_version;
  $("action-seq").textContent = s.last_action_seq;
  for (const q of s.flash || []) flash.set(q.flash_id, q);
  if (s.reasoning && !$("reasoning").textContent) $("reasoning").textContent = s.reasoning;
  renderFlash();
}

function updateFlash(ev) {
  const q = flash.get(ev.flash_id) || { flash_id: ev.flash_id, question: ev.question, history: [] };
  q.answer = ev.answer;
  q.data_version = ev.data_version;
  q.confidence = ev.confidence;
  q.history = (q.history || []).concat([{ data_version: ev.data_version, logit_gap: ev.confidence.logit_gap,
                                          mean_prob: ev.confidence.mean_prob, at: ev.evaluated_at }]);
  flash.set(ev.flash_id, q);
}

function renderFlash() {
  const body = $("flash");
  body.textContent = "";
  for (const q of flash.values()) {
    const tr = document.createElement("tr");
    tr.dataset.flashId = q.flash_id;
    const conf = q.confidence ? `p ${q.confidence.mean_prob.toFixed(2)}, gap ${q.confidence.logit_gap.toFixed(2)}` : "–";
    const cells = [q.flash_id, q.question, q.answer ?? "(not yet)", q.data_version ?? "–", conf];
    cells.forEach((v, i) => {
      const td = document.createElement("td");
      td.textContent = v;
      if (i === 2) td.className = "answer";
      tr.appendChild(td);
    });
    body.appendChild(tr);
  }
  renderChart();
}

function renderChart() {
  const svg = $("chart");
  const NS = "http://www.w3.org/2000/svg";
  svg.textContent = "";
  $("legend").textContent = "";
  const series = [...flash.values()].map((q) => (q.history || []).filter((h) => h.mean_prob != null));
  const versions = series.flat().map((h) => h.data_version);
  if (!versions.length) return;
  const lo = Math.min(...versions), hi = Math.max(...versions, lo + 1);
  const x = (v) => 10 + ((v - lo) / (hi - lo)) * 580;
  const y = (p) => 150 - p * 140;
  for (const p of [0, 0.5, 1]) {
    const line = document.createElementNS(NS, "line");
    Object.entries({ x1: 10, x2: 590, y1: y(p), y2: y(p), stroke: "#dde", "stroke-width": 1 })
      .forEach(([k, v]) => line.setAttribute(k, v));
    svg.appendChild(line);
  }
  [...flash.values()].forEach((q, i) => {
    const color = COLORS[i % COLORS.length];
    const pts = series[i].map((h) => `${x(h.data_version).toFixed(1)},${y(h.mean_prob).toFixed(1)}`);
    const poly = document.createElementNS(NS, "polyline");
    poly.setAttribute("points", pts.join(" "));
    poly.setAttribute("fill", "none");
    poly.setAttribute("stroke", color);
    poly.setAttribute("stroke-width", 2);
    svg.appendChild(poly);
    for (const h of series[i]) {
      const dot = document.createElementNS(NS, "circle");
      dot.setAttribute("cx", x(h.data_version));
      dot.setAttribute("cy", y(h.mean_prob));
      dot.setAttribute("r", 3);
      dot.setAttribute("fill", color);
      svg.appendChild(dot);
    }
    const item = document.createElement("span");
    item.style.color = color;
    item.textContent = `■ ${q.flash_id}  `;
    $("legend").appendChild(item);
  });
}

function appendReasoning(text) {
  const pre = $("reasoning");
  pre.textContent = (pre.textContent + text).slice(-4000);
  pre.scrollTop = pre.scrollHeight;
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

function fmtBytes(n) {
  if (n == null) return "–";
  if (n < 1024) return n + " B";
  if (n < 1 << 20) return (n / 1024).toFixed(1) + " KiB";
  return (n / (1 << 20)).toFixed(1) + " MiB";
}

function fmtTime(t) {
  return t ? new Date(t * 1000).toISOString().slice(11, 23) : "–";
}

connect();
setInterval(listSessions, 1000);
