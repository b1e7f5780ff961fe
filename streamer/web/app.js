// The /app page: stream text, camera and microphone into a session from a browser, ask, keep
// flash questions answered. Built on the SDK (/sdk/streamer.js, /sdk/capture.js). The session id,
// its producer token and its unacknowledged inputs live in localStorage, so a reload resumes it;
// the API key stays in sessionStorage (this tab only). `window.streamerApp` is for debugging.
import { StreamerClient, defaultUrl } from "/sdk/streamer.js";
import { Camera, MEDIA_REFUSED, Microphone } from "/sdk/capture.js";

const SAVED = "streamer.app.session";
const KEY = "streamer.app.apiKey";
const FEED_ITEMS = 60;
const FILE_CHUNK_CHARS = 1200;
// Questions and flash questions end after the sentence that answers, as in `streamer demo`
// (docs/protocol.md, "Penalties"): small models otherwise loop or invent more.
const ANSWER_STYLE = { frequency_penalty: 0.3, end_bias: 3 };
// A session this far behind (or with inputs not yet acknowledged) is asked over what it has read
// so far (`query.create` `over: "read"`) rather than after everything sent: the answer comes now.
const LAGGING_MS = 2000;

const $ = (id) => document.getElementById(id);
const app = { client: null, session: null, camera: null, mic: null, lagS: [], rate: [], video: {}, audio: {} };
window.streamerApp = app;

// ---- connection and session ----------------------------------------------------------------

function apiKey() { return $("api-key").value.trim() || null; }

/** A new session's id, chosen here so that the proxy in front of a cluster routes it (and every
 * later connection of it) to one worker; a server without a proxy takes it as it is. */
function newSessionId() {
  const bytes = crypto.getRandomValues(new Uint8Array(8));
  return "app-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

/** The route key of a session id: the id its creator chose (without a `<key name>:` prefix). */
function routeOf(sessionId) {
  const at = sessionId.indexOf(":");
  return at >= 0 ? sessionId.slice(at + 1) : sessionId;
}

async function connect(route = null) {
  const key = apiKey();
  if (app.client && !app.client.closing) {
    // The key travels only when the websocket opens: a key typed (or changed) after a refused
    // "New session" needs a new connection, not the old keyless one (while no session uses it).
    if (((app.client.apiKey ?? null) === key && (app.client.routeKey ?? null) === route) || app.session) {
      return app.client;
    }
    app.client.close();
    app.client = null;
  }
  sessionStorage.setItem(KEY, key ?? "");
  // ?session=<id>: behind a cluster's proxy every connection of the session reaches its worker
  const client = await StreamerClient.connect(defaultUrl(), { apiKey: key, session: route });
  const mine = (fn) => (ev) => { if (app.client === client) fn(ev); };  // not a connection left behind
  client.on("open", mine(() => setConn("live")));
  client.on("close", mine((ev) => setConn(ev.reconnecting ? "reconnecting…" : "offline")));
  client.on("resumed", mine((ev) => note(`reconnected: session resumed (${ev.event.replayed_records} records replayed)`)));
  client.on("inputs", mine(() => { save(); $("unacked").textContent = app.session?.unacked.size ?? 0; }));
  client.on("error", mine((ev) => showError(ev.error)));
  app.client = client;
  setConn("live");
  return client;
}

async function createSession(event) {
  event.preventDefault();
  await guard(async () => {
    const client = await connect(newSessionId());
    const options = {};
    if ($("system-prompt").value.trim()) options.systemPrompt = $("system-prompt").value.trim();
    if ($("thinking").checked) options.thinking = { mode: "dual" };
    const session = await client.createSession(options);
    attach(session);
    note(`new session ${session.id}`);
  });
}

async function resume(sessionId, token, saved = null) {
  const client = await connect(routeOf(sessionId));
  const session = await client.resumeSession(sessionId, token, saved);
  attach(session);
  const ev = session.resumed;
  note(`resumed session ${session.id}: ${fmtCount(ev.session.inputs)} inputs, data_version ${ev.session.data_version}` +
       (ev.replayed_records ? `, ${ev.replayed_records} records replayed` : ""));
  renderState(ev.session);
  return session;
}

async function resumeSaved() {
  const saved = load();
  if (!saved) return;
  try {
    await resume(saved.session_id, saved.tokens.producer, saved);
  } catch (err) {
    if (err.code === "session_not_found") localStorage.removeItem(SAVED);
    showError(err, `could not resume session ${saved.session_id}`);
  }
}

function attach(session) {
  app.session = session;
  $("sid").textContent = session.id;
  for (const id of ["send-text", "end-input", "camera", "mic", "ask", "register", "stop"]) $(id).disabled = false;
  $("create").disabled = true;
  if (app.mediaRefused) for (const id of ["camera", "mic"]) $(id).disabled = true;
  session.on("input.ack", (ev) => {
    if (ev.lag_ms != null) showLag(ev.lag_ms, "text");
    if (ev.total_tokens != null) $("tokens").textContent = fmtTokens(ev.total_tokens);
  });
  session.on("media.ack", onMediaAck);
  for (const type of ["media.observation", "media.transcript"]) {
    session.on(type, (ev) => {
      if (ev.total_tokens != null) $("tokens").textContent = fmtTokens(ev.total_tokens);
      if (ev.lag_ms != null) showLag(ev.lag_ms, type === "media.transcript" ? "audio" : "video");
    });
  }
  session.on("media.observation", onObservation);
  session.on("media.transcript", onTranscript);
  session.on("reasoning.delta", (ev) => appendReasoning(ev.delta));
  session.on("reasoning.done", (ev) => endNote(ev));
  session.on("error", (ev) => showError(ev.error));
  session.on("session.lost", (ev) => { showError(ev.error, "the session is gone"); detach(); });
  session.on("*", () => renderVersion());
  for (const q of session.flash.values()) session.onFlash(q.flash_id, renderFlash);
  renderFlash();
  save();
}

function detach() {
  app.camera?.stop();
  app.mic?.stop();
  app.camera = app.mic = null;
  app.session = null;
  localStorage.removeItem(SAVED);
  for (const id of ["send-text", "end-input", "camera", "mic", "ask", "register", "stop"]) $(id).disabled = true;
  $("create").disabled = false;
  $("camera").textContent = "Start camera";
  $("mic").textContent = "Start microphone";
}

async function stop() {
  await guard(async () => {
    const session = app.session;
    await app.camera?.stop();
    await app.mic?.stop();
    const final = await session.close();
    note(`session ${session.id} closed after ${fmtCount(final.inputs)} inputs`);
    detach();
  });
}

function save() {
  if (app.session) localStorage.setItem(SAVED, JSON.stringify(app.session.toJSON()));
}

function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(SAVED));
    return saved?.session_id && saved?.tokens?.producer ? saved : null;
  } catch {
    return null;
  }
}

// ---- text ------------------------------------------------------------------------------------

function sendText() {
  let text = $("text-input").value;
  if (!text.trim() || !app.session) return;
  if (!/\s$/.test(text)) text += "\n";  // inputs are never re-tokenized together: keep words apart
  $("text-input").value = "";
  app.session.append(text).then((ack) => textNote(`input ${ack.seq ?? ack.client_seq} in the cache`), showError);
}

async function streamFile(file) {
  if (!app.session || !file) return;
  const text = await file.text();
  const chunks = chunksOf(text, FILE_CHUNK_CHARS);
  let done = 0;
  textNote(`${file.name}: streaming ${chunks.length} pieces`);
  await Promise.all(chunks.map((chunk) => app.session.append(chunk).then(() => {
    done += 1;
    textNote(`${file.name}: ${done}/${chunks.length} pieces in the cache`);
  }, showError)));
}

/** Pieces of at most `size` characters, cut after whitespace where there is some. */
function chunksOf(text, size) {
  const out = [];
  for (let i = 0; i < text.length;) {
    let end = Math.min(text.length, i + size);
    if (end < text.length) {
      const space = text.lastIndexOf(" ", end);
      const line = text.lastIndexOf("\n", end);
      const cut = Math.max(space, line);
      if (cut > i) end = cut + 1;
    }
    out.push(text.slice(i, end));
    i = end;
  }
  return out;
}

// ---- camera and microphone -------------------------------------------------------------------

async function toggleCamera() {
  await guard(async () => {
    if (app.camera) {
      app.camera.stop();
      app.camera = null;
      $("preview").srcObject = null;
      $("camera").textContent = "Start camera";
      return;
    }
    const camera = new Camera(app.session, { mode: $("camera-mode").value, fps: Number($("jpeg-fps").value) || 2,
                                             onRefused: (error) => mediaRefused("camera", error) });
    app.camera = camera;
    $("camera").textContent = "Stop camera";
    try {
      $("preview").srcObject = await camera.start();
    } catch (err) {
      app.camera = null;
      $("camera").textContent = "Start camera";
      throw err;
    }
    note(`camera: ${camera.mode === "webm" ? "WebM pieces" : `JPEG snapshots at ${camera.options.fps} fps`}`);
  });
}

async function toggleMic() {
  await guard(async () => {
    if (app.mic) {
      await app.mic.stop();
      app.mic = null;
      $("mic").textContent = "Start microphone";
      return;
    }
    const mic = new Microphone(app.session, { onRefused: (error) => mediaRefused("mic", error) });
    app.mic = mic;
    $("mic").textContent = "Stop microphone";
    try {
      await mic.start();
    } catch (err) {
      app.mic = null;
      $("mic").textContent = "Start microphone";
      throw err;
    }
    note(`microphone: PCM s16le at ${mic.stats.sampleRate} Hz`);
  });
}

/** The server refused a media frame (a server without media input, or without the media extra):
 * the device stopped itself (capture.js); the page says so and offers no media until a reload. */
function mediaRefused(device, error) {
  app.mediaRefused = error;
  if (device === "camera") {
    app.camera = null;
    $("preview").srcObject = null;
  } else {
    app.mic = null;
  }
  $("camera").textContent = "Start camera";
  $("mic").textContent = "Start microphone";
  for (const id of ["camera", "mic"]) {
    $(id).disabled = true;
    $(id).title = "this server does not take camera or microphone input";
  }
  showError(error);
}

function onMediaAck(ev) {
  const m = ev.media ?? {};
  if (ev.kind === "audio") app.audio = m;
  else app.video = m;
}

function onObservation(ev) {
  const lag = Date.now() / 1000 - ev.capture_ts;  // glass to cache, on the page's clock
  app.lagS.push(lag);
  if (app.lagS.length > 200) app.lagS.shift();
  $("video-lag").textContent = `${fmtMs(lag * 1000)} (server ${fmtMs(ev.lag_ms)})`;
  feed("observations", ev.text ?? `${fmtCount(ev.visual_tokens)} visual tokens`, fmtMediaTime(ev.start_s));
}

function onTranscript(ev) {
  const list = $("transcripts");
  let item = list.querySelector(`li[data-segment="${ev.segment}"]`);
  if (!item) {
    item = feed("transcripts", ev.text, fmtMediaTime(ev.start_s));
    item.dataset.segment = ev.segment;
  }
  item.querySelector(".text").textContent = ev.text;
  item.classList.toggle("partial", !ev.final);
}

function feed(listId, text, label) {
  const list = $(listId);
  const item = document.createElement("li");
  const when = document.createElement("span");
  when.className = "when";
  when.textContent = label;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  item.append(when, body);
  list.prepend(item);
  while (list.children.length > FEED_ITEMS) list.lastChild.remove();
  return item;
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

// ---- questions -------------------------------------------------------------------------------

async function ask(event) {
  event.preventDefault();
  const question = $("question").value.trim();
  if (!question || !app.session) return;
  $("question").value = "";
  const item = document.createElement("li");
  item.className = "qa";
  const q = document.createElement("div");
  q.className = "q";
  q.textContent = question;
  const a = document.createElement("div");
  a.className = "a streaming";
  const meta = document.createElement("div");
  meta.className = "note";
  item.append(q, a, meta);
  $("answers").prepend(item);
  try {
    for await (const ev of answer(question, { max_tokens: 96, ...ANSWER_STYLE })) {
      if (ev.type === "query.delta") a.textContent += ev.delta;
      else {
        a.textContent = ev.text.trim() || "(an empty answer)";
        meta.textContent = ev.cached ? `from the flash cache, data_version ${ev.data_version}` :
          `${fmtCount(ev.tokens)} tokens, ${fmtMs(ev.timing.total_ms)}, data_version ${ev.data_version} (${ev.finish_reason})`;
        if (ev.over === "read") {  // asked over what was read: say how much that was
          meta.textContent = `answered over ${fmtCount(ev.data_version)} inputs; ${fmtCount(ev.unread_inputs)} still ` +
            `being read · ${meta.textContent}`;
          item.classList.add("over-read");
        }
      }
    }
  } catch (err) {
    meta.textContent = errorText(err);
  } finally {
    a.classList.remove("streaming");
  }
}

/** Whether the session is behind what the page sent: inputs not yet acknowledged, or the last
 * ingest lag over LAGGING_MS. */
function lagging() {
  return (app.session?.unacked.size ?? 0) > 0 || (app.lagMs ?? 0) > LAGGING_MS;
}

/** The question's events; over what the session has read so far when it is lagging. A server
 * that does not know `over` yet refuses it (unknown_field): then the question goes again without
 * it, and the page stops asking that server for it. */
async function* answer(question, options) {
  const overRead = app.overRead !== false && lagging();
  app.lastAsk = overRead ? "read" : "sent";
  try {
    yield* app.session.ask(question, overRead ? { ...options, over: "read" } : options);
  } catch (err) {
    if (!(overRead && err.code === "unknown_field" && err.param === "over")) throw err;
    app.overRead = false;
    app.lastAsk = "sent";
    yield* app.session.ask(question, options);
  }
}

async function registerFlash(event) {
  event.preventDefault();
  const question = $("flash-question").value.trim();
  if (!question || !app.session) return;
  await guard(async () => {
    await app.session.registerFlash(question, { max_tokens: 24, ...ANSWER_STYLE }, renderFlash);
    $("flash-question").value = "";
    renderFlash();
  });
}

function renderFlash() {
  const session = app.session;
  const body = $("flash-rows");
  body.textContent = "";
  if (!session) return;
  for (const q of session.flash.values()) {
    const tr = document.createElement("tr");
    tr.dataset.flashId = q.flash_id;
    const st = session.staleness(q.flash_id);
    const behind = st ? st.versions : null;
    const stale = st && (st.stale || st.versions > 0);
    tr.classList.toggle("stale", Boolean(stale));
    const cells = [q.question, q.answer ?? "(not yet)", q.data_version != null ? `v${q.data_version}` : "–",
                   st == null ? "–" : st.stale ? `stale · ${fmtAge(st.seconds)}`
                     : behind > 0 ? `${behind} behind · ${fmtAge(st.seconds)}` : `current · ${fmtAge(st.seconds)}`];
    cells.forEach((text, i) => {
      const td = document.createElement("td");
      td.textContent = text;
      td.className = ["question", "answer", "version", "staleness"][i];
      if (text === "–") td.classList.add("none");
      tr.appendChild(td);
    });
    const td = document.createElement("td");
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "remove";
    remove.textContent = "×";
    remove.title = "unregister";
    remove.onclick = () => guard(async () => { await session.unregisterFlash(q.flash_id); renderFlash(); });
    td.appendChild(remove);
    tr.appendChild(td);
    body.appendChild(tr);
  }
}

// ---- numbers ---------------------------------------------------------------------------------

function renderState(state) {
  if (!state) return;
  $("inputs").textContent = fmtCount(state.inputs);
  $("tokens").textContent = fmtTokens(state.tokens);
  renderVersion();
}

function renderVersion() {
  if (app.session) $("version").textContent = app.session.dataVersion;
}

function tick() {
  const client = app.client;
  app.ticks = (app.ticks ?? 0) + 1;
  // Flash answers are pushed only when they change: the state says which version each one
  // was last evaluated on, so staleness stays true between pushes.
  if (app.session?.attached && client?.connected && app.ticks % 2 === 0) {
    app.session.get().then((st) => { renderState(st); renderFlash(); }, () => {});
  }
  if (client) {  // bytes per second over the last 5 s
    const now = performance.now();
    app.rate.push([now, client.stats.bytesSent]);
    while (app.rate.length > 1 && now - app.rate[0][0] > 5000) app.rate.shift();
    const [t0, b0] = app.rate[0];
    const rate = now > t0 ? (client.stats.bytesSent - b0) / ((now - t0) / 1000) : 0;
    $("rate").textContent = `${fmtBytes(rate)}/s`;
  }
  const cam = app.camera, mic = app.mic, v = app.video;
  const off = app.mediaRefused ? "off (the server takes no media)" : "off";
  $("video-stats").textContent = cam ? `${cam.mode}: ${fmtCount(cam.stats.pieces)} pieces, ${fmtBytes(cam.stats.bytes)}; ` +
    `${fmtCount(v.decoded ?? 0)} decoded, ${fmtCount(v.sampled ?? 0)} sampled, ${fmtCount(v.observations ?? 0)} observations`
    : off;
  $("dropped").textContent = `${fmtCount(v.dropped ?? 0)} by the server (newest frame wins), ` +
    `${fmtCount((cam?.stats.unsent ?? 0) + (client?.stats.mediaDropped ?? 0))} not sent by the page`;
  $("audio-stats").textContent = mic ? `${fmtCount(mic.stats.pieces)} pieces, ${fmtBytes(mic.stats.bytes)}, ` +
    `${fmtCount(app.audio.transcripts ?? 0)} transcripts` : off;
  $("mic-level").value = mic?.stats.peak ?? 0;
  renderFlash();
}

function showLag(ms, source) {
  app.lagMs = ms;
  $("lag").textContent = `${fmtMs(ms)} (${source})`;
}

// Numbers with their units, rounded to what a reader uses: "250 ms" (not "0.25 s" or
// "250.37 ms"), "1.4 s", "3 min"; "980 B", "1.2 KiB", "3.4 MiB"; counts with thousands separators.
function fmtMs(ms) {
  if (ms == null || !Number.isFinite(Number(ms))) return "–";
  const n = Math.max(0, Number(ms));
  if (n < 1000) return `${Math.round(n)} ms`;
  if (n < 60_000) return `${(n / 1000).toFixed(n < 10_000 ? 1 : 0)} s`;
  return fmtAge(n / 1000);
}

function fmtAge(s) {
  return s < 90 ? `${Math.round(s)} s` : s < 5400 ? `${Math.round(s / 60)} min` : `${(s / 3600).toFixed(1)} h`;
}

function fmtMediaTime(s) {  // a position in the media: "12.3 s", "2:05.0"
  if (s == null) return "–";
  if (s < 60) return `${Number(s).toFixed(1)} s`;
  return `${Math.floor(s / 60)}:${(s % 60).toFixed(1).padStart(4, "0")}`;
}

function fmtBytes(n) {
  if (n < 1024) return `${Math.round(n)} B`;
  const units = ["KiB", "MiB", "GiB"];
  let v = n / 1024, i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return `${v.toFixed(v < 10 ? 1 : 0)} ${units[i]}`;
}

function fmtCount(n) { return n == null ? "–" : Number(n).toLocaleString("en-US"); }

function fmtTokens(n) { return `${fmtCount(n)} tok`; }

// ---- page ------------------------------------------------------------------------------------

function setConn(text) { $("conn").textContent = text; }

function note(text) { $("session-note").textContent = text; }

function textNote(text) { $("text-note").textContent = text; }

function showError(err, context = "") {
  const box = $("error");
  box.textContent = `${context ? context + ": " : ""}${errorText(err)}`;
  box.hidden = false;
}

/** An error as the page says it: its code once, then what it means here. The server's messages
 * speak to API clients (e.g. "send 'Authorization: Bearer <key>'", which a page cannot do), so
 * the codes a browser user can act on get the page's own words. */
function errorText(err) {
  const code = err?.code ?? "error";
  let detail = String(err?.detail ?? err?.message ?? err);
  if (detail.startsWith(`${code}: `)) detail = detail.slice(code.length + 2);
  if (code === "unauthorized") {
    return `${code}: this server needs an API key. Type it in the API key field above and click ` +
           "New session again (or open /app?api_key=KEY).";
  }
  if (code === "connection_failed" && apiKey()) {
    return `${code}: the server refused the connection with this API key; check the key (${detail})`;
  }
  if (MEDIA_REFUSED.has(code)) {
    return `${code}: this server does not take camera or microphone input, so the page stopped them ` +
           `(${detail}). Text and questions still work.`;
  }
  return `${code}: ${detail}`;
}

async function guard(fn) {
  try {
    $("error").hidden = true;
    await fn();
  } catch (err) {
    showError(err);
  }
}

function init() {
  const params = new URLSearchParams(location.search);
  $("api-key").value = params.get("api_key") ?? sessionStorage.getItem(KEY) ?? "";
  $("session-form").addEventListener("submit", createSession);
  $("stop").onclick = stop;
  $("resume").onclick = () => guard(() => resume($("resume-id").value.trim(), $("resume-token").value.trim()));
  $("send-text").onclick = sendText;
  $("text-input").addEventListener("keydown", (ev) => { if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) sendText(); });
  $("text-file").onchange = (ev) => streamFile(ev.target.files[0]);
  $("end-input").onclick = () => guard(async () => { await app.session.end(); textNote("input ended"); });
  for (const type of ["dragover", "drop"]) {
    $("text-panel").addEventListener(type, (ev) => {
      ev.preventDefault();
      if (type === "drop") streamFile(ev.dataTransfer.files[0]);
    });
  }
  $("camera").onclick = toggleCamera;
  $("mic").onclick = toggleMic;
  $("ask-form").addEventListener("submit", ask);
  $("flash-form").addEventListener("submit", registerFlash);
  $("error").onclick = () => { $("error").hidden = true; };
  setInterval(tick, 1000);
  resumeSaved();
}

init();
