// AudioWorklet processor "pcm-s16le": microphone samples (float, the context's rate) ->
// mono signed 16-bit little-endian pieces of `pieceSamples` samples, posted to the page with
// the audio clock time of their first sample and their peak level. Loaded by capture.js.
class PcmS16le extends AudioWorkletProcessor {
  constructor(options) {
    super();
    this.size = options.processorOptions?.pieceSamples ?? 1600;
    this.piece = new Int16Array(this.size);
    this.filled = 0;
    this.peak = 0;
    this.start = 0;
  }

  process(inputs) {
    const channels = inputs[0];
    if (!channels || channels.length === 0) return true;
    const n = channels[0].length;
    for (let i = 0; i < n; i++) {
      let v = 0;
      for (const ch of channels) v += ch[i];
      v = Math.max(-1, Math.min(1, v / channels.length));
      if (this.filled === 0) this.start = currentTime + i / sampleRate;
      this.piece[this.filled++] = v < 0 ? v * 0x8000 : v * 0x7fff;
      this.peak = Math.max(this.peak, Math.abs(v));
      if (this.filled === this.size) {
        // Int16Array is in the platform's byte order: little-endian on every browser platform.
        this.port.postMessage({ pcm: this.piece.buffer, start: this.start, peak: this.peak }, [this.piece.buffer]);
        this.piece = new Int16Array(this.size);
        this.filled = 0;
        this.peak = 0;
      }
    }
    return true;
  }
}

registerProcessor("pcm-s16le", PcmS16le);
