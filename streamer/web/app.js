// The /app page: stream text, camera and microphone into a session from a browser, ask, keep
// flash questions answered. Built on the SDK (/sdk/streamer.js, /sdk/capture.js). The session id,
// its producer token and its unacknowledged inputs live in localStorage, so a reload resumes it;
// the API key stays in sessionStorage (this tab only). `window.streamerApp` is for debugging.
import { StreamerClient, defaultUrl } from "/sdk/streamer.js";
import { Camera, Microphone } from "/sdk/capture.js";

const SAVED = "streamer.app.session";
const KEY = "streamer.app.apiKey";
const FEED_ITEMS = 60;
const FILE_CHUNK_CHARS = 1200;
// Questions and flash questions end after the sentence that answers, as in `streamer demo`
// (docs/protocol.md, "Penalties"): small models otherwise loop or invent more.
const ANSWER_STYLE = { frequency_penalty: 0.3, end_bias: 3 };

const $ = (id) => document.getElementById(id);
const app = { client: null, session: null, camera: null, mic: null, lagS: [], rate: [], video: {}, audio: {} };
window.streamerApp = app;

// ---- connection and session ----------------------------------------------------------------

function apiKey() { return $("api-key").value.trim() || null; }

async function connect() {
  if (app.client && !app.client.closing) return app.client;
  sessionStorage.setItem(KEY, apiKey() ?? "");
  const client = await StreamerClient.connect(defaultUrl(), { apiKey: apiKey() });
  client.on("open", () => setConn("live"));
  client.on("close", (ev) => setConn(ev.reconnecting ? "reconnecting…" : "offline"));
  client.on("resumed", (ev) => note(`reconnected: session resumed (${ev.event.replayed_records} records replayed)`));
  client.on("inputs", () => { save(); $("unacked").textContent = app.session?.unacked.size ?? 0; });
  client.on("error", (ev) => showError(ev.error));
  app.client = client;
  setConn("live");
  return client;
}

async function createSession(event) {
  event.preventDefault();
  await guard(async () => {
    const client = await connect();
    const options = {};
    if ($("system-prompt").value.trim()) options.systemPrompt = $("system-prompt").value.trim();
    if ($("thinking").checked) options.thinking = { mode: "dual" };
    const session = await client.createSession(options);
    attach(session);
    note(`new session ${session.id}`);
  });
}

async function resume(sessionId, token, saved = null) {
  const client = await connect();
  const session = await client.resumeSession(sessionId, token, saved);
  attach(session);
  const ev = session.resumed;
  note(`resumed session ${session.id}: ${ev.session.inputs} inputs, data_version ${ev.session.data_version}` +
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
  session.on("input.ack", (ev) => {
    if (ev.lag_ms != null) $("lag").textContent = `${ev.lag_ms} ms (text)`;
    if (ev.total_tokens != null) $("tokens").textContent = `${ev.total_tokens} tok`;
  });
  session.on("media.ack", onMediaAck);
  for (const type of ["media.observation", "media.transcript"]) {
    session.on(type, (ev) => {
        if (ev.total_tokens != null) $("tokens").textContent = `${ev.total_tokens} tok`;
      if (ev.lag_ms != null) $("lag").textContent = `${ev.lag_ms} ms (video)`;
    });
  }
  session.on("media.observation", onObservation);
  session.on("media.transcript", onTranscript);
  session.on("reasoning.delta", (ev) => appendReasoning(ev.delta));
  session.on("reasoning.done", () => appendReasoning("\n"));
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
    note(`session ${session.id} closed after ${final.inputs} inputs`);
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
    const camera = new Camera(app.session, { mode: $("camera-mode").value, fps: Number($("jpeg-fps").value) || 2 });
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
    const mic = new Microphone(app.session);
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

function onMediaAck(ev) {
  const m = ev.media ?? {};
  if (ev.kind === "audio") app.audio = m;
  else app.video = m;
}

function onObservation(ev) {
  const lag = Date.now() / 1000 - ev.capture_ts;  // glass to cache, on the page's clock
  app.lagS.push(lag);
  if (app.lagS.length > 200) app.lagS.shift();
  $("video-lag").textContent = `${Math.round(lag * 1000)} ms (server ${ev.lag_ms} ms)`;
  feed("observations", ev.text ?? `${ev.visual_tokens} visual tokens`, `${ev.start_s}s`);
}

function onTranscript(ev) {
  const list = $("transcripts");
  let item = list.querySelector(`li[data-segment="${ev.segment}"]`);
  if (!item) {
    item = feed("transcripts", ev.text, `${ev.start_s.toFixed(1)}s`);
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

function appendReasoning(text) {
  const pre = $("reasoning");
  pre.textContent = (pre.textContent + text).slice(-4000);
  pre.scrollTop = pre.scrollHeight;
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
    for await (const ev of app.session.ask(question, { max_tokens: 96, ...ANSWER_STYLE })) {
      if (ev.type === "query.delta") a.textContent += ev.delta;
      else {
        a.textContent = ev.text.trim() || "(an empty answer)";
        meta.textContent = ev.cached ? `from the flash cache, data_version ${ev.data_version}` :
          `${ev.tokens} tokens, ${ev.timing.total_ms} ms, data_version ${ev.data_version} (${ev.finish_reason})`;
      }
    }
  } catch (err) {
    meta.textContent = `${err.code}: ${err.message}`;
  } finally {
    a.classList.remove("streaming");
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
                   st == null ? "–" : st.stale ? `stale · ${Math.round(st.seconds)} s`
                     : behind > 0 ? `${behind} behind · ${Math.round(st.seconds)} s` : `current · ${Math.round(st.seconds)} s`];
    cells.forEach((text, i) => {
      const td = document.createElement("td");
      td.textContent = text;
      td.className = ["question", "answer", "version", "staleness"][i];
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
  $("inputs").textContent = state.inputs;
  $("tokens").textContent = `${state.tokens} tok`;
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
    $("rate").textContent = `${(rate / 1024).toFixed(1)} KiB/s`;
  }
  const cam = app.camera, mic = app.mic, v = app.video;
  $("video-stats").textContent = cam ? `${cam.mode}: ${cam.stats.pieces} pieces, ${kib(cam.stats.bytes)}; ` +
    `${v.decoded ?? 0} decoded, ${v.sampled ?? 0} sampled, ${v.observations ?? 0} observations` : "off";
  $("dropped").textContent = `${v.dropped ?? 0} by the server (newest frame wins), ` +
    `${(cam?.stats.unsent ?? 0) + (client?.stats.mediaDropped ?? 0)} not sent by the page`;
  $("audio-stats").textContent = mic ? `${mic.stats.pieces} pieces, ${kib(mic.stats.bytes)}, ` +
    `${app.audio.transcripts ?? 0} transcripts` : "off";
  $("mic-level").value = mic?.stats.peak ?? 0;
  renderFlash();
}

function kib(n) { return `${(n / 1024).toFixed(1)} KiB`; }

// ---- page ------------------------------------------------------------------------------------

function setConn(text) { $("conn").textContent = text; }

function note(text) { $("session-note").textContent = text; }

function textNote(text) { $("text-note").textContent = text; }

function showError(err, context = "") {
  const e = err?.code ? err : { code: "error", message: String(err?.message ?? err) };
  const box = $("error");
  box.textContent = `${context ? context + ": " : ""}${e.code}: ${e.message}`;
  box.hidden = false;
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
