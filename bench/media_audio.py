"""Audio real-time factor: seconds of speech a session's audio stream handles per second.

Speech is synthesised with espeak-ng (sentences with pauses between them) and streamed in
100 ms pieces as fast as the stream takes them, measured side by side in one run:

- streaming, default settings (decode + resample + Silero VAD + partial and final Whisper
  tiny.en transcripts), as PCM and as Ogg-Opus;
- streaming, finals only (no partials);
- decode + voice activity alone (no transcription);
- offline: one faster-whisper call over the whole recording (what a batch job pays).

An audio_rtf above 1 keeps up with a live microphone. Model loading is excluded (warm-up).

    python bench/media_audio.py [--seconds 30]
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import time
import wave

import numpy as np

SENTENCES = ["turn on the lights in the kitchen", "we need more coffee", "the meeting starts at ten",
             "please open the kitchen window", "the train leaves from platform two", "good morning everyone",
             "my name is robert", "the cat sat on the mat"]


def speech(seconds: float) -> tuple[bytes, int]:
    """About `seconds` of espeak-ng sentences with 0.8 s pauses, as s16le mono PCM and its rate."""
    parts, total, rate, i = [], 0.0, 22050, 0
    while total < seconds:
        wav = subprocess.run(["espeak-ng", "-s", "130", "--stdout", SENTENCES[i % len(SENTENCES)]],
                             check=True, capture_output=True).stdout
        with wave.open(io.BytesIO(wav)) as w:
            rate = w.getframerate()
            parts.append(np.frombuffer(w.readframes(w.getnframes()), "<i2"))
        parts.append(np.zeros(int(0.8 * rate), np.int16))
        total += (len(parts[-2]) + len(parts[-1])) / rate
        i += 1
    return np.concatenate(parts).tobytes(), rate


def ogg_opus(pcm: bytes, rate: int) -> bytes:
    import av

    out = io.BytesIO()
    with av.open(out, "w", format="ogg") as c:
        stream = c.add_stream("libopus", rate=48000)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(np.frombuffer(pcm, "<i2")[None, :], format="s16", layout="mono")
        frame.sample_rate = rate
        resampler = av.AudioResampler(format=stream.format.name, layout="mono", rate=48000)
        pts = 0
        for piece in [*resampler.resample(frame), *resampler.resample(None)]:
            piece.pts, pts = pts, pts + piece.samples
            for packet in stream.encode(piece):
                c.mux(packet)
        for packet in stream.encode(None):
            c.mux(packet)
    return out.getvalue()


def stream_once(data: bytes, fmt: str, rate: int | None, piece: int, **options) -> tuple[float, list]:
    """Seconds to stream `data` through an AudioStream in `piece`-byte pieces, and its transcripts."""
    from streamer.vision.audio import AudioStream

    s = AudioStream(fmt, rate, 1 if rate else None, **options)
    began = time.perf_counter()
    out = []
    for i in range(0, len(data), piece):
        out += s.feed(data[i:i + piece])
    out += s.finish()
    return time.perf_counter() - began, out


class NoTranscription:
    """Decode and voice activity only: segments are found, nothing is transcribed."""

    def transcribe(self, audio: np.ndarray) -> str:
        return ""


def measure_audio_rtf(seconds: float = 20.0, fmt: str = "pcm_s16le", report: dict | None = None) -> float:
    """Real-time factor of a default AudioStream (partials and finals) on `seconds` of espeak-ng
    speech streamed as `fmt` ("pcm_s16le" or "opus") in 100 ms pieces. `report`, if given,
    receives the transcripts' counts."""
    from streamer.vision.asr import FasterWhisperTranscriber

    pcm, rate = speech(seconds)
    audio_s = len(pcm) / 2 / rate
    FasterWhisperTranscriber().transcribe(np.zeros(16000, np.float32))  # load and warm up
    if fmt == "opus":
        data, piece, src_rate = ogg_opus(pcm, rate), 400, None  # ~32 kbit/s: 100 ms is ~400 bytes
    else:
        data, piece, src_rate = pcm, rate // 5, rate  # 100 ms of s16 mono
    took, out = stream_once(data, fmt, src_rate, piece)
    if report is not None:
        report.update(audio_s=audio_s, seconds=took, finals=sum(t.final for t in out),
                      partials=sum(not t.final for t in out))
    return audio_s / took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    from faster_whisper.audio import decode_audio  # noqa: F401  (fail early without the media extra)
    from streamer.vision.asr import FasterWhisperTranscriber

    pcm, rate = speech(args.seconds)
    audio_s = len(pcm) / 2 / rate
    whisper = FasterWhisperTranscriber()
    whisper.transcribe(np.zeros(16000, np.float32))
    print(f"audio: {audio_s:.1f} s of espeak-ng speech, {len(SENTENCES)} sentences cycled, 100 ms pieces")

    pcm_report, opus_report = {}, {}
    rtf_pcm = measure_audio_rtf(args.seconds, "pcm_s16le", pcm_report)
    rtf_opus = measure_audio_rtf(args.seconds, "opus", opus_report)
    finals_s, finals = stream_once(pcm, "pcm_s16le", rate, rate // 5, partial_every_s=0)
    decode_s, _ = stream_once(pcm, "pcm_s16le", rate, rate // 5, transcriber=NoTranscription())

    from streamer.vision.asr_decode import make_decoder, take

    d = make_decoder("pcm_s16le", rate, 1)
    d.feed(pcm)
    d.finish()
    x = take(d)
    began = time.perf_counter()
    whole = whisper.transcribe(x)
    offline_s = time.perf_counter() - began

    rows = [("streaming pcm (partials + finals)", rtf_pcm, pcm_report),
            ("streaming opus (partials + finals)", rtf_opus, opus_report),
            ("streaming pcm, finals only", audio_s / finals_s, {"finals": len(finals), "partials": 0}),
            ("decode + VAD only", audio_s / decode_s, {}),
            ("offline, one call over the recording", audio_s / offline_s, {})]
    for name, rtf, rep in rows:
        extra = f"  finals={rep['finals']} partials={rep['partials']}" if "finals" in rep else ""
        print(f"{name:40s} rtf={rtf:7.2f}  (x{rtf / rtf_pcm:5.2f} of streaming pcm){extra}")
    print(f"offline words: {len(whole.split())}, streaming finals words: {sum(len(t.text.split()) for t in finals)}")
    print(f"RESULT audio_rtf={rtf_pcm:.2f}")


if __name__ == "__main__":
    sys.exit(main())
