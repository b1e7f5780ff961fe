// capture.js: camera and microphone into a streamer session (browser only; uses streamer.js).
//
//   import { Camera, Microphone } from "/sdk/capture.js";
//   const camera = new Camera(session, { mode: "auto" });  // WebM pieces, or JPEG snapshots
//   await camera.start();  video.srcObject = camera.stream;
//   const mic = new Microphone(session);                   // PCM s16le, 16 kHz mono
//   await mic.start();
//
// Every media frame's `ts` is the page's clock at capture, so the server's observation lag
// (`lag_ms`, and `capture_ts` on media.observation) measures glass to cache.

const WEBM = "video/webm;codecs=vp8";

/** The error codes with which a server refuses media frames: `unexpected_binary` (a server
 * started without media input refuses every binary frame) and `unsupported_media` (its media
 * extra is not installed, or a kind or format it does not read). Capture stops on either:
 * every further piece would only draw another refusal (and, past the refusal allowance, get
 * the connection closed). */
export const MEDIA_REFUSED = new Set(["unexpected_binary", "unsupported_media"]);

/** Call `fn(error)` once on the first media refusal for `session` (errors of the session, or
 * of the connection: `unexpected_binary` names no session); returns a function that stops. */
function onRefusal(session, fn) {
  const off = session.client.on("error", (ev) => {
    if (!MEDIA_REFUSED.has(ev.error?.code) || (ev.session_id && ev.session_id !== session.id)) return;
    off();
    fn(ev.error);
  });
  return off;
}

/** Whether this browser can record the camera as WebM (else the camera sends JPEG snapshots). */
export function canRecordWebm() {
  return typeof MediaRecorder !== "undefined" && MediaRecorder.isTypeSupported(WEBM);
}

/** The camera as WebM pieces from MediaRecorder (`video`/`webm`), or JPEG snapshots drawn on a
 * canvas at `fps` (`image`/`jpeg`) where the browser cannot record WebM (mode "auto"). */
export class Camera {
  constructor(session, { mode = "auto", fps = 2, timesliceMs = 100, width = 320, height = 240,
                         frameRate = 10, videoBitsPerSecond = 250_000, jpegQuality = 0.7, onRefused = null } = {}) {
    this.session = session;
    this.onRefused = onRefused;  // (error) after the server refused media and the camera stopped
    this.refused = null;         // that error
    this.options = { fps, timesliceMs, width, height, frameRate, videoBitsPerSecond, jpegQuality };
    this.mode = mode === "auto" ? (canRecordWebm() ? "webm" : "jpeg") : mode;
    this.stream = null;
    this.running = false;
    this.stats = { pieces: 0, bytes: 0, unsent: 0, containers: 0 };
    this._chain = Promise.resolve();  // pieces leave in capture order
    this._offResumed = null;
  }

  async start(stream = null) {
    const { width, height, frameRate } = this.options;
    this.stream = stream ?? await navigator.mediaDevices.getUserMedia({
      video: { width: { ideal: width }, height: { ideal: height }, frameRate: { ideal: frameRate } }, audio: false });
    this.running = true;
    this._offRefusal = onRefusal(this.session, (error) => this._refused(error));
    if (this.mode === "webm") {
      this._record();
      // A new connection means a new media stream on the server: start a new container.
      this._offResumed = this.session.client.on("resumed", (ev) => {
        if (ev.session === this.session && this.running) this._restart();
      });
    } else {
      await this._snapshots();
    }
    return this.stream;
  }

  stop() {
    this.running = false;
    this._offResumed?.();
    this._offRefusal?.();
    clearInterval(this._timer);
    if (this.recorder && this.recorder.state !== "inactive") this.recorder.stop();  // onstop sends `end`
    for (const track of this.stream?.getTracks() ?? []) track.stop();
  }

  _refused(error) {  // nothing more leaves: no pieces still queued, no end-of-container frame
    this.refused = error;
    this.stop();
    this.onRefused?.(error);
  }

  _send(header, data) {
    this._chain = this._chain.then(async () => {
      if (this.refused) return;
      const buf = data instanceof Blob ? await data.arrayBuffer() : data;
      if (this.refused) return;  // refused while this piece was read
      if (this.session.sendMedia(header, buf)) {
        this.stats.pieces += 1;
        this.stats.bytes += buf.byteLength;
      } else {
        this.stats.unsent += 1;
      }
    });
  }

  _record() {
    const tracks = new MediaStream(this.stream.getVideoTracks());
    const recorder = new MediaRecorder(tracks, { mimeType: WEBM, videoBitsPerSecond: this.options.videoBitsPerSecond });
    this.recorder = recorder;
    this.stats.containers += 1;
    // The container's first frame is the first one captured after start(): stamp the first
    // piece with the time of the call (early by less than a frame interval; the `start` event
    // comes later still, once the encoder is up). The server stamps each frame ts + its pts.
    let pieceTs = Date.now() / 1000;
    let sendEnd = true;
    recorder.ondataavailable = (ev) => {
      if (ev.data.size === 0) return;
      const ts = pieceTs;
      pieceTs = Date.now() / 1000;  // the next piece starts after this one
      this._send({ kind: "video", format: "webm", ts }, ev.data);
    };
    recorder.onstop = () => {
      if (sendEnd && !this.refused) this._send({ kind: "video", format: "webm", end: true }, new ArrayBuffer(0));
    };
    recorder._dropEnd = () => { sendEnd = false; };
    recorder.start(this.options.timesliceMs);
  }

  _restart() {
    const old = this.recorder;
    old._dropEnd();  // the server's stream for the old container went with the old connection
    old.ondataavailable = null;
    if (old.state !== "inactive") old.stop();
    this._record();
  }

  async _snapshots() {
    const video = document.createElement("video");
    video.muted = true;
    video.playsInline = true;
    video.srcObject = this.stream;
    await video.play();
    const canvas = document.createElement("canvas");
    this._timer = setInterval(() => {
      if (!video.videoWidth) return;
      const ts = Date.now() / 1000;
      canvas.width = video.videoWidth;
      canvas.height = video.videoHeight;
      canvas.getContext("2d").drawImage(video, 0, 0);
      canvas.toBlob((blob) => blob && this._send({ kind: "image", format: "jpeg", ts }, blob),
                    "image/jpeg", this.options.jpegQuality);
    }, 1000 / this.options.fps);
  }
}

/** The microphone as PCM s16le mono at 16 kHz (the browser resamples), in pieces of
 * `pieceMs`, from an AudioWorklet. Where the browser cannot run a 16 kHz context on the
 * microphone, the context's own rate is sent (the server resamples). */
export class Microphone {
  constructor(session, { pieceMs = 100, sampleRate = 16000, workletUrl = null, onRefused = null } = {}) {
    this.session = session;
    this.onRefused = onRefused;  // (error) after the server refused media and the microphone stopped
    this.refused = null;
    this.pieceMs = pieceMs;
    this.sampleRate = sampleRate;
    this.workletUrl = workletUrl ?? new URL("./pcm-worklet.js", import.meta.url).href;
    this.stats = { pieces: 0, bytes: 0, unsent: 0, peak: 0, sampleRate: null };
    this.running = false;
  }

  async start(stream = null) {
    this.stream = stream ?? await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false }, video: false });
    let source;
    try {
      this.ctx = new AudioContext({ sampleRate: this.sampleRate });
      source = this.ctx.createMediaStreamSource(this.stream);
    } catch (err) {  // e.g. a browser that will not resample a microphone: use its own rate
      await this.ctx?.close();
      this.ctx = new AudioContext();
      source = this.ctx.createMediaStreamSource(this.stream);
    }
    const rate = this.ctx.sampleRate;
    this.stats.sampleRate = rate;
    await this.ctx.audioWorklet.addModule(this.workletUrl);
    this.node = new AudioWorkletNode(this.ctx, "pcm-s16le",
                                     { processorOptions: { pieceSamples: Math.round(rate * this.pieceMs / 1000) } });
    this.node.port.onmessage = (ev) => this._piece(ev.data, rate);
    const mute = this.ctx.createGain();  // keep the graph pulled without playing the microphone back
    mute.gain.value = 0;
    source.connect(this.node).connect(mute).connect(this.ctx.destination);
    await this.ctx.resume();
    this.running = true;
    this._offRefusal = onRefusal(this.session, (error) => {
      this.refused = error;
      this.stop().then(() => this.onRefused?.(error));
    });
    return this.stream;
  }

  _piece({ pcm, start, peak }, rate) {
    if (!this.running) return;
    const ts = Date.now() / 1000 - Math.max(0, this.ctx.currentTime - start);  // first sample's capture time
    this.stats.peak = peak;
    const header = { kind: "audio", format: "pcm_s16le", ts, sample_rate: rate, channels: 1 };
    if (this.session.sendMedia(header, pcm)) {
      this.stats.pieces += 1;
      this.stats.bytes += pcm.byteLength;
    } else {
      this.stats.unsent += 1;
    }
  }

  async stop() {
    if (!this.running) return;
    this.running = false;
    this._offRefusal?.();
    if (!this.refused) {
      this.session.sendMedia({ kind: "audio", format: "pcm_s16le", sample_rate: this.stats.sampleRate, channels: 1,
                               end: true }, new ArrayBuffer(0));
    }
    for (const track of this.stream?.getTracks() ?? []) track.stop();
    await this.ctx?.close();
  }
}
