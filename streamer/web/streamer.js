// streamer.js: the JavaScript SDK of the streamer service. One ES module, no build step, no
// dependencies; served at /sdk/streamer.js and usable from a saved copy.
//
//   import { StreamerClient } from "/sdk/streamer.js";
//   const client = await StreamerClient.connect("ws://127.0.0.1:8765/", { apiKey });
//   const session = await client.createSession({ systemPrompt: "Answer in a few words." });
//   await session.append("The keeper's name is Ada Morrow. ");
//   for await (const ev of session.ask("Who is the keeper?")) {
//     if (ev.type === "query.delta") out.textContent += ev.delta;   // last: the query.done
//   }
//
// Commands and events are the types of docs/protocol.md; COMMANDS maps every command to the
// method that sends it. Inputs carry a client_seq and are kept until acknowledged: when the
// connection drops the client reconnects with backoff, sends `session.resume` with the producer
// token and resends, in order, exactly the inputs above the `last_client_seq` the server
// reports (the rules of the Python SDK, streamer.clients.client). Browsers cannot set headers
// on a websocket, so the API key travels as `?api_key=` on the URL.

/** Every client command of docs/protocol.md and the SDK method that sends it. */
export const COMMANDS = Object.freeze({
  "session.create": "StreamerClient.createSession",
  "session.resume": "StreamerClient.resumeSession",
  "sessions.list": "StreamerClient.listSessions",
  "subscribe": "StreamerClient.subscribe",
  "unsubscribe": "Session.unsubscribe",
  "session.update": "Session.update",
  "session.get": "Session.get",
  "session.close": "Session.close",
  "input.text.append": "Session.append",
  "input.text.revise": "Session.revise",
  "input.end": "Session.end",
  "query.create": "Session.ask",
  "query.cancel": "Session.cancelQuery",
  "flash.register": "Session.registerFlash",
  "flash.unregister": "Session.unregisterFlash",
  "action.rule": "Session.addRule",
  "action.rule.remove": "Session.removeRule",
  "action.start": "Session.startActions",
  "action.stop": "Session.stopActions",
  "robot.state": "Session.robotState",
  "media": "Session.sendMedia",  // the binary media frame
});

const FLASH_EVENTS = new Set(["flash.updated", "flash.stale"]);
const STORE_UNAVAILABLE = "store_unavailable";  // not logged, not applied: resent after a resume

/** An `error` event from the server (or a lost connection: code "connection_closed"). */
export class StreamerError extends Error {
  constructor(error, event = null) {
    super(`${error.code}: ${error.message}`);
    this.name = "StreamerError";
    this.code = error.code;
    this.detail = error.message;  // the server's message without the code in front
    this.recoverable = error.recoverable ?? true;
    this.param = error.param ?? null;
    this.owner = error.owner ?? null;
    this.event = event;
  }
}

/** A binary media frame: u32 big-endian header length, UTF-8 JSON header, payload. */
export function mediaFrame(header, payload) {
  const head = new TextEncoder().encode(JSON.stringify(header));
  const body = payload instanceof Uint8Array ? payload : new Uint8Array(payload ?? new ArrayBuffer(0));
  const frame = new Uint8Array(4 + head.length + body.length);
  new DataView(frame.buffer).setUint32(0, head.length, false);
  frame.set(head, 4);
  frame.set(body, 4 + head.length);
  return frame;
}

/** A URL with `api_key` set (browsers cannot send an Authorization header on a websocket). */
export function withApiKey(url, apiKey) {
  if (!apiKey) return url;
  const u = new URL(url);
  u.searchParams.set("api_key", apiKey);
  return u.toString();
}

/** `url` with ?session=<key>: the session key a cluster's proxy hashes (docs/cluster.md). */
export function withRoute(url, key) {
  const u = new URL(url);
  u.searchParams.set("session", key);
  return u.toString();
}

/** The websocket URL of the page's own server (ws: or wss: like the page). */
export function defaultUrl() {
  if (typeof location === "undefined" || !location.host) return "ws://127.0.0.1:8765/";
  return `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/`;
}

class Emitter {
  constructor() { this._handlers = new Map(); }

  /** Call `fn(event)` for events of `type` ("*": all); returns a function that removes it. */
  on(type, fn) {
    if (!this._handlers.has(type)) this._handlers.set(type, new Set());
    this._handlers.get(type).add(fn);
    return () => this.off(type, fn);
  }

  off(type, fn) { this._handlers.get(type)?.delete(fn); }

  _emit(type, event) {
    for (const key of [type, "*"]) {
      for (const fn of this._handlers.get(key) ?? []) {
        try { fn(event); } catch (err) { console.error("streamer: a handler failed", err); }
      }
    }
  }
}

/** A running question: async-iterate for its `query.delta` events, then its `query.done`. */
export class QueryStream {
  constructor(session, queryId) {
    this.session = session;
    this.queryId = queryId;
    this.text = "";
    this.result = null;  // the query.done event
    this._queue = [];
    this._wake = null;
    this.done = new Promise((resolve, reject) => { this._resolve = resolve; this._reject = reject; });
    this.done.catch(() => {});  // awaited by whoever wants it; iteration rethrows
  }

  _feed(event) {
    if (this.result || this._failed) return;
    if (event.type === "query.delta") this.text += event.delta;
    else if (event.type === "query.done") { this.result = event; this._resolve(event); }
    else { this._failed = new StreamerError(event.error, event); this._reject(this._failed); }
    this._queue.push(event);
    this._wake?.();
  }

  async *[Symbol.asyncIterator]() {
    for (;;) {
      while (this._queue.length) {
        const event = this._queue.shift();
        if (event.type === "error") throw new StreamerError(event.error, event);
        yield event;
        if (event.type === "query.done") return;
      }
      await new Promise((resolve) => { this._wake = resolve; });
      this._wake = null;
    }
  }

  /** Stop the question; its query.done comes with finish_reason "cancelled". */
  cancel() { return this.session.cancelQuery(this.queryId); }
}

/** A session seen from this client: the producer's (create/resume) or a read-only watch (subscribe). */
export class Session extends Emitter {
  constructor(client, sessionId, { tokens = {}, state = null, role = "producer", nextClientSeq = 1 } = {}) {
    super();
    this.client = client;
    this.id = sessionId;
    this.tokens = tokens;          // role -> capability token (session.created gives them once)
    this.role = role;              // "producer" or "subscriber"
    this.state = state;            // last state the server sent (created, resumed, state, subscribed)
    this.dataVersion = state?.data_version ?? 0;
    this.flash = new Map();        // flash_id -> latest flash state/event (answer, data_version, evaluated_at)
    for (const q of state?.flash ?? []) this.flash.set(q.flash_id, q);
    this.nextClientSeq = nextClientSeq;
    this.unacked = new Map();      // client_seq -> {msg, resolve, reject, sentOn}
    this.mediaSeq = { video: 0, audio: 0 };  // video and images share a stream; audio has its own
    this.attached = role === "producer";  // false while a reconnect has not resumed it yet
    this.closed = false;
    this._flashCallbacks = new Map();
  }

  // ---- text input (kept until acknowledged) ------------------------------------------------

  /** input.text.append; resolves with its input.ack (possibly after a reconnect and a resend). */
  append(text) {
    return this._input({ type: "input.text.append", session_id: this.id, text });
  }

  /** input.text.revise: replace the inputs from `fromSeq` (default: the last) with `text`. */
  revise(text, fromSeq = undefined) {
    const msg = { type: "input.text.revise", session_id: this.id, text };
    if (fromSeq !== undefined && fromSeq !== null) msg.from_seq = fromSeq;
    return this._input(msg);
  }

  _input(msg) {
    msg.client_seq = this.nextClientSeq++;
    return new Promise((resolve, reject) => {
      this.unacked.set(msg.client_seq, { msg, resolve, reject, sentOn: -1 });
      this.client._inputsChanged(this);
      if (this.attached && this.client.connected) this._sendInput(msg.client_seq);
    });
  }

  _sendInput(clientSeq) {
    const entry = this.unacked.get(clientSeq);
    entry.sentOn = this.client.generation;
    this.client._send({ ...entry.msg }, { input: [this, clientSeq] });
  }

  _inputReply(clientSeq, event) {
    const entry = this.unacked.get(clientSeq);
    if (!entry) return;
    if (event.type === "input.ack") {
      this.unacked.delete(clientSeq);
      if (event.data_version != null) this.dataVersion = Math.max(this.dataVersion, event.data_version);
      entry.resolve(event);
    } else {  // refused: the client_seq is spent (correct the input and send it anew) ...
      if (event.error?.code !== STORE_UNAVAILABLE) this.unacked.delete(clientSeq);  // ... unless not logged
      entry.reject(new StreamerError(event.error, event));
    }
    this.client._inputsChanged(this);
  }

  /** After session.resumed: inputs at or below `lastClientSeq` are in the log (acknowledged
   * here as duplicates); the rest are resent in order. */
  _resumed(event) {
    const last = event.last_client_seq ?? 0;
    if (event.session) this._state(event.session);
    this.nextClientSeq = Math.max(this.nextClientSeq, last + 1);
    this.attached = true;
    for (const seq of [...this.unacked.keys()].sort((a, b) => a - b)) {
      if (seq <= last) {
        const entry = this.unacked.get(seq);
        this.unacked.delete(seq);
        entry.resolve({ type: "input.ack", session_id: this.id, client_seq: seq, duplicate: true, resumed: true });
      } else {
        this._sendInput(seq);
      }
    }
    this.client._inputsChanged(this);
  }

  _lost(error) {  // the session cannot be resumed: every kept input fails
    this.attached = false;
    this.closed = true;
    for (const entry of this.unacked.values()) entry.reject(error);
    this.unacked.clear();
    this.client._inputsChanged(this);
    this._emit("session.lost", { type: "session.lost", session_id: this.id, error });
  }

  /** What a page needs to resume this session after a reload (see StreamerClient.resumeSession). */
  toJSON() {
    return { session_id: this.id, tokens: this.tokens, next_client_seq: this.nextClientSeq,
             unacked: [...this.unacked.values()].map((e) => e.msg) };
  }

  // ---- other commands -----------------------------------------------------------------------

  /** input.end: no more input; resolves with its input.ack {ended: true}. */
  end() { return this._request({ type: "input.end" }); }

  /** session.get: the session's state (media counters included). */
  async get() {
    const ev = await this._request({ type: "session.get" });
    this._state(ev.session);
    return ev.session;
  }

  _state(state) {  // a fresh state: current version, and each flash answer as last evaluated
    this.state = state;
    this.dataVersion = Math.max(this.dataVersion, state.data_version ?? 0);
    for (const q of state.flash ?? []) this.flash.set(q.flash_id, { ...(this.flash.get(q.flash_id) ?? {}), ...q });
  }

  /** session.update: {thinking} and/or {window}. */
  async update({ thinking, window } = {}) {
    const msg = { type: "session.update" };
    if (thinking) msg.thinking = thinking;
    if (window) msg.window = window;
    return (await this._request(msg)).session;
  }

  /** session.close: the session ends here and everywhere; resolves with its final state. */
  async close() {
    const ev = await this._request({ type: "session.close" });
    this.closed = true;
    this.client.sessions.delete(this.id);
    return ev.session;
  }

  /** query.create; options: queryId, max_tokens, temperature, top_p, top_k, seed, stop, stream,
   * repetition_penalty, presence_penalty, frequency_penalty, end_bias, over (where the server
   * takes it: "read" answers over what the session has read so far). */
  ask(question, options = {}) {
    const { queryId, ...rest } = options;
    const id = queryId ?? `jq${this.client._nextQuery++}`;
    const stream = new QueryStream(this, id);
    const key = `${this.id}\u0000${id}`;
    this.client._queries.set(key, stream);
    if (this.client._send({ type: "query.create", session_id: this.id, question, query_id: id, ...rest },
                          { query: stream }) === null) this.client._queries.delete(key);
    return stream;
  }

  /** query.cancel of a running question. */
  cancelQuery(queryId) {
    this.client._send({ type: "query.cancel", session_id: this.id, query_id: queryId });
  }

  /** flash.register; `callback(event)` gets its flash.updated (and flash.stale) events.
   * options: flashId, max_tokens, priority, min_interval_ms, confirm, repetition_penalty,
   * presence_penalty, frequency_penalty, end_bias. Resolves with its state. */
  async registerFlash(question, options = {}, callback = null) {
    const { flashId, ...rest } = options;
    const msg = { type: "flash.register", question, ...rest };
    if (flashId) msg.flash_id = flashId;
    const ev = await this._request(msg);
    this.flash.set(ev.flash.flash_id, ev.flash);
    if (callback) this._flashCallbacks.set(ev.flash.flash_id, callback);
    return ev.flash;
  }

  /** Call `callback(event)` on the flash events of a question registered earlier (after a reload). */
  onFlash(flashId, callback) { this._flashCallbacks.set(flashId, callback); }

  async unregisterFlash(flashId) {
    await this._request({ type: "flash.unregister", flash_id: flashId });
    this.flash.delete(flashId);
    this._flashCallbacks.delete(flashId);
  }

  /** How far a flash answer is behind: {versions, seconds} (null before its first answer). */
  staleness(flashId, now = Date.now() / 1000) {
    const q = this.flash.get(flashId);
    if (!q || q.data_version == null) return null;
    const at = q.evaluated_at ?? now;
    return { versions: Math.max(0, this.dataVersion - q.data_version), seconds: Math.max(0, now - at),
             stale: q.stale === true };
  }

  /** action.rule: when flash `flashId`'s answer changes to match `pattern`, `command` fires. */
  async addRule({ flashId, pattern, command, debounceMs, ruleId }) {
    const msg = { type: "action.rule", flash_id: flashId, pattern, command };
    if (debounceMs != null) msg.debounce_ms = debounceMs;
    if (ruleId) msg.rule_id = ruleId;
    return (await this._request(msg)).rule;
  }

  async removeRule(ruleId) { return this._request({ type: "action.rule.remove", rule_id: ruleId }); }

  /** action.start; options: policy, mode, dt_ms, horizon, latency_ms, gain, max_speed. */
  async startActions(options = {}) { return (await this._request({ type: "action.start", ...options })).actions; }

  async stopActions() { return this._request({ type: "action.stop" }); }

  /** robot.state (no reply unless refused: a refusal arrives as an "error" event). */
  robotState(state, ts = Date.now() / 1000) {
    this.client._send({ type: "robot.state", session_id: this.id, state, ts });
  }

  /** unsubscribe a watch made with StreamerClient.subscribe. */
  async unsubscribe() {
    await this._request({ type: "unsubscribe" });
    this.client.subscriptions.delete(this.id);
  }

  /** One binary media frame. header: kind ("video" | "image" | "audio"), format, ts (capture
   * time of the first sample, seconds; default now), sample_rate and channels (pcm_s16le),
   * end, live. The seq is assigned here (video and images share a stream, audio has its own).
   * Returns false when the frame was not sent: no open connection, or a live picture while
   * more than `maxBufferedBytes` wait in the socket (newest frame wins). */
  sendMedia(header, payload) {
    const client = this.client;
    const group = header.kind === "audio" ? "audio" : "video";
    const ws = client.ws;
    if (!this.attached || !client.connected) return false;
    if (header.kind === "image" && header.live !== false && ws.bufferedAmount > client.maxBufferedBytes) {
      client.stats.mediaDropped += 1;
      return false;
    }
    const full = { session_id: this.id, ts: Date.now() / 1000, ...header, seq: this.mediaSeq[group]++ };
    const frame = mediaFrame(full, payload);
    ws.send(frame);
    client._count("media", frame.byteLength);
    client.stats.mediaBytes[group] += frame.byteLength;
    return true;
  }

  _request(msg) {
    return this.client.request({ ...msg, session_id: this.id });
  }

  _event(event) {
    if (event.data_version != null && event.type !== "query.done" && !FLASH_EVENTS.has(event.type)) {
      this.dataVersion = Math.max(this.dataVersion, event.data_version);
    }
    if (event.type === "session.snapshot") this.dataVersion = Math.max(this.dataVersion, event.snapshot.data_version);
    if (FLASH_EVENTS.has(event.type)) this._flashEvent(event);
    const type = event.type === "input.ack" && event.media_seq != null ? "media.ack" : event.type;
    this._emit(type, event);
  }

  _flashEvent(event) {
    // flash.stale may name one question or (without flash_id) all of the session's questions.
    const ids = event.flash_id ? [event.flash_id] : [...this.flash.keys()];
    for (const id of ids) {
      const q = { ...(this.flash.get(id) ?? { flash_id: id }) };
      if (event.type === "flash.updated") Object.assign(q, event, { stale: false });
      else Object.assign(q, { stale: true, stale_reason: event.reason ?? event.message ?? null });
      this.flash.set(id, q);
      const fn = this._flashCallbacks.get(id);
      if (fn) {
        try { fn(event, q); } catch (err) { console.error("streamer: a flash callback failed", err); }
      }
    }
  }
}

/** One websocket to a streamer server, kept open: reconnects and resumes its sessions. */
export class StreamerClient extends Emitter {
  /** Open a connection. options: apiKey, reconnect (default true), minBackoffMs (250),
   * maxBackoffMs (5000), maxBufferedBytes (4 MiB: live pictures beyond it are dropped),
   * session: behind a cluster's proxy (docs/cluster.md), the id of the session this connection
   * is for: it goes in the URL as ?session=<id> (the key the proxy hashes), createSession
   * uses it as the new session's id, and every reconnect goes to that same URL. */
  static async connect(url = defaultUrl(), options = {}) {
    const client = new StreamerClient(url, options);
    await client.opened();
    return client;
  }

  constructor(url = defaultUrl(), { apiKey = null, reconnect = true, minBackoffMs = 250, maxBackoffMs = 5000,
                                    maxBufferedBytes = 4 << 20, session = null } = {}) {
    super();
    this.routeKey = session;
    this.homeUrl = session ? withRoute(url, session) : url;  // every reconnect starts here again
    this.url = this.homeUrl;
    this.apiKey = apiKey;
    this.reconnect = reconnect;
    this.minBackoffMs = minBackoffMs;
    this.maxBackoffMs = maxBackoffMs;
    this.maxBufferedBytes = maxBufferedBytes;
    this.sessions = new Map();       // session id -> Session this client produces into
    this.subscriptions = new Map();  // session id -> Session watched read-only (with its token)
    this.generation = 0;             // bumped per connection
    this.connected = false;
    this.closing = false;
    this.stats = { sent: {}, received: {}, bytesSent: 0, framesSent: 0, mediaDropped: 0,
                   mediaBytes: { video: 0, audio: 0 }, reconnects: 0 };
    this._pending = new Map();       // event_id -> {resolve, reject, input?, query?}
    this._queries = new Map();       // session id + query id -> QueryStream
    this._nextId = 1;
    this._nextQuery = 1;
    this._backoff = minBackoffMs;
    this._open();
  }

  /** Resolves once the connection is open (rejects if the first attempt fails). */
  opened() { return this._firstOpen; }

  /** session.create; options: systemPrompt, sessionId, flash (list), thinking, window. */
  async createSession({ systemPrompt, sessionId, flash, thinking, window } = {}) {
    const msg = { type: "session.create" };
    if (systemPrompt) msg.system_prompt = systemPrompt;
    if (sessionId ?? this.routeKey) msg.session_id = sessionId ?? this.routeKey;
    if (flash) msg.flash = flash;
    if (thinking) msg.thinking = thinking;
    if (window) msg.window = window;
    const ev = await this.request(msg);
    const session = new Session(this, ev.session_id, { tokens: ev.tokens, state: ev.session });
    session.model = ev.model;
    this.sessions.set(session.id, session);
    return session;
  }

  /** session.resume: take back a session by id and producer token (after a reload or from
   * another client). `saved` may be the object Session.toJSON() gave: its unacknowledged
   * inputs are resent if the server lacks them. Resolves with the Session (`resumed`: the
   * server's session.resumed event). */
  async resumeSession(sessionId, token, saved = null) {
    const session = new Session(this, sessionId, {
      tokens: saved?.tokens ?? { producer: token }, nextClientSeq: saved?.next_client_seq ?? 1 });
    session.attached = false;
    for (const msg of saved?.unacked ?? []) {
      session.unacked.set(msg.client_seq, { msg, resolve: () => {}, reject: () => {}, sentOn: -1 });
    }
    const ev = await this.request({ type: "session.resume", session_id: sessionId, token,
                                    last_client_seq: Math.max(0, session.nextClientSeq - 1) });
    session.resumed = ev;
    this.sessions.set(sessionId, session);
    session._resumed(ev);
    return session;
  }

  /** subscribe: watch a session read-only with one of its tokens (or, holding an API key,
   * without one). Resolves with a Session whose `on()` gets the pushed events. */
  async subscribe(sessionId, token = null) {
    const msg = { type: "subscribe", session_id: sessionId };
    if (token) msg.token = token;
    const ev = await this.request(msg);
    const watch = new Session(this, sessionId, { tokens: token ? { subscriber: token } : {}, state: ev.session,
                                                  role: "subscriber" });
    watch._token = token;
    this.subscriptions.set(sessionId, watch);
    return watch;
  }

  /** sessions.list (needs an API key): {sessions: snapshots, worker}. */
  async listSessions(sessionId = null) {
    const msg = { type: "sessions.list" };
    if (sessionId ?? this.routeKey) msg.session_id = sessionId ?? this.routeKey;
    const ev = await this.request(msg);
    return { sessions: ev.sessions, worker: ev.worker };
  }

  /** Send a command and wait for the event that replies to it; an error event rejects. */
  request(msg) {
    return new Promise((resolve, reject) => { this._send(msg, { resolve, reject }); });
  }

  /** Close for good (no reconnect). Sessions stay on the server until their detach TTL. */
  close() {
    this.closing = true;
    clearTimeout(this._retry);
    this.ws?.close(1000, "client closed");
  }

  // ---- plumbing -----------------------------------------------------------------------------

  _send(msg, waiter = null) {
    if (!this.connected) {  // nothing goes out: whoever waits hears it now, not never
      const error = { code: "connection_closed", message: "not connected", recoverable: true };
      waiter?.reject?.(new StreamerError(error));
      waiter?.query?._feed({ type: "error", error });
      return null;
    }
    msg.event_id = `j${this._nextId++}`;
    if (waiter) this._pending.set(msg.event_id, waiter);
    const text = JSON.stringify(msg);
    this.ws.send(text);
    this._count(msg.type, text.length);
    return msg.event_id;
  }

  _count(type, bytes) {
    this.stats.sent[type] = (this.stats.sent[type] ?? 0) + 1;
    this.stats.bytesSent += bytes;
    this.stats.framesSent += 1;
  }

  _inputsChanged(session) { this._emit("inputs", { type: "inputs", session }); }

  _open() {
    const ws = new WebSocket(withApiKey(this.url, this.apiKey));
    ws.binaryType = "arraybuffer";
    this.ws = ws;
    let opened = false;
    const first = !this._firstOpen;
    if (first) {
      this._firstOpen = new Promise((resolve, reject) => { this._openResolve = resolve; this._openReject = reject; });
    }
    ws.onopen = () => {
      opened = true;
      this.connected = true;
      this.generation += 1;
      this._backoff = this.minBackoffMs;
      if (first) this._openResolve(this);
      else this._reattach();
      this._emit("open", { type: "open", generation: this.generation });
    };
    ws.onmessage = (msg) => {
      if (typeof msg.data === "string") this._dispatch(JSON.parse(msg.data));
    };
    ws.onclose = (ev) => {
      this.connected = false;
      this._failPending();
      this._emit("close", { type: "close", code: ev.code, reason: ev.reason, reconnecting: this._willRetry() });
      if (first && !opened) {
        this._openReject(new StreamerError({ code: "connection_failed",
                                             message: `cannot open ${this.url} (close ${ev.code})` }));
        return;
      }
      if (this._willRetry()) this._scheduleRetry();
    };
  }

  _willRetry() { return this.reconnect && !this.closing; }

  _scheduleRetry() {
    // A `moved` sent this attempt to the owner's URL; any later reconnect goes through the URL
    // the client was given (a proxy's, or a worker that may adopt the session): never pinned.
    if (this._following) this._following = false;
    else this.url = this.homeUrl;
    const delay = this._backoff;
    this._backoff = Math.min(this.maxBackoffMs, this._backoff * 2);
    this._retry = setTimeout(() => { this.stats.reconnects += 1; this._open(); }, delay);
  }

  /** A lost connection: replies it waited for fail, running questions end with an error;
   * inputs stay kept (their sessions resend them after the resume). */
  _failPending() {
    const error = { code: "connection_closed", message: "the connection closed", recoverable: true };
    for (const [, waiter] of this._pending) {
      if (waiter.reject) waiter.reject(new StreamerError(error));
      if (waiter.query) waiter.query._feed({ type: "error", error });
    }
    this._pending.clear();
    for (const stream of this._queries.values()) stream._feed({ type: "error", error });
    this._queries.clear();
    for (const session of this.sessions.values()) session.attached = false;
  }

  /** After a reconnect: resume every session this client produced into, resubscribe watches. */
  async _reattach() {
    for (const session of [...this.sessions.values()]) {
      try {
        const ev = await this.request({ type: "session.resume", session_id: session.id,
                                        token: session.tokens.producer,
                                        last_client_seq: Math.max(0, session.nextClientSeq - 1) });
        session.resumed = ev;
        session._resumed(ev);
        this._emit("resumed", { type: "resumed", session, event: ev });
      } catch (err) {
        if (err.code === "moved") {  // another worker owns it (or owned it and has not been declared dead yet)
          // Behind a proxy: the same URL again, after a backoff (the proxy routes it to the owner,
          // or to the worker adopting it). Direct to workers: the owner's URL, for this attempt only.
          if (err.owner?.url && !this.routeKey && err.owner.url !== this.url) {
            this.url = err.owner.url;
            this._following = true;
          }
          this.ws.close(4000, "moved");
          return;
        }
        if (err.code === "connection_closed") return;  // lost again; the next attempt retries
        this.sessions.delete(session.id);
        session._lost(err);
      }
    }
    for (const watch of [...this.subscriptions.values()]) {
      try {
        const msg = { type: "subscribe", session_id: watch.id };
        if (watch._token) msg.token = watch._token;
        watch.state = (await this.request(msg)).session;
      } catch (err) {
        if (err.code === "connection_closed") return;
        this.subscriptions.delete(watch.id);
        watch._lost(err);
      }
    }
  }

  _dispatch(ev) {
    this.stats.received[ev.type] = (this.stats.received[ev.type] ?? 0) + 1;
    if (ev.type === "query.delta" || ev.type === "query.done") {
      const key = `${ev.session_id}\u0000${ev.query_id}`;
      const stream = this._queries.get(key);
      if (ev.type === "query.done") {
        this._queries.delete(key);
        this._pending.delete(ev.reply_to);
      }
      if (stream) stream._feed(ev);
      this._toSession(ev);
      return;
    }
    const waiter = ev.reply_to != null ? this._pending.get(ev.reply_to) : undefined;
    if (waiter) {
      this._pending.delete(ev.reply_to);
      if (waiter.input) waiter.input[0]._inputReply(waiter.input[1], ev);
      else if (waiter.query) {
        this._queries.delete(`${waiter.query.session.id}\u0000${waiter.query.queryId}`);
        waiter.query._feed(ev);
      } else if (ev.type === "error") waiter.reject(new StreamerError(ev.error, ev));
      else waiter.resolve(ev);
      if (ev.type !== "error") this._toSession(ev);
      return;
    }
    this._toSession(ev);
    this._emit(ev.type, ev);
  }

  _toSession(ev) {
    const session = this.sessions.get(ev.session_id) ?? this.subscriptions.get(ev.session_id);
    if (session) session._event(ev);
  }
}
