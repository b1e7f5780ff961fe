"""Generated speech for audio tests: espeak-ng sentences (Debian package `espeak-ng`; a test
that needs it is skipped with the install line when it is missing), Ogg-Opus/ADTS encoding
with PyAV, random cuts, and how much of a sentence a transcript heard."""

import io
import random
import re
import shutil
import subprocess
import wave

import numpy as np
import pytest

FIRST = "turn on the lights in the kitchen"
SECOND = "we need more coffee"


def speech(text: str) -> tuple[np.ndarray, int]:
    """espeak-ng speech as int16 samples and their rate (22050 Hz mono)."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng)")
    wav = subprocess.run(["espeak-ng", "-s", "130", "--stdout", text], check=True, capture_output=True).stdout
    with wave.open(io.BytesIO(wav)) as w:
        rate = w.getframerate()
        return np.frombuffer(w.readframes(w.getnframes()), "<i2").copy(), rate


def conversation() -> tuple[np.ndarray, int, list[float]]:
    """1 s silence, FIRST, 1.5 s silence, SECOND, 1 s silence; and when each sentence starts."""
    a, rate = speech(FIRST)
    b, _ = speech(SECOND)
    quiet = lambda s: np.zeros(int(s * rate), np.int16)
    starts = [1.0, 1.0 + len(a) / rate + 1.5]
    return np.concatenate([quiet(1.0), a, quiet(1.5), b, quiet(1.0)]), rate, starts


def encode(samples: np.ndarray, rate: int, container: str, codec: str, codec_rate: int) -> bytes:
    """Mono int16 samples -> a container byte stream, encoded with PyAV."""
    out = io.BytesIO()
    import av

    with av.open(out, "w", format=container) as c:
        stream = c.add_stream(codec, rate=codec_rate)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(samples[None, :], format="s16", layout="mono")
        frame.sample_rate = rate
        resampler = av.AudioResampler(format=stream.format.name, layout="mono", rate=codec_rate)
        pts = 0
        for piece in [*resampler.resample(frame), *resampler.resample(None)]:
            piece.pts, pts = pts, pts + piece.samples
            for packet in stream.encode(piece):
                c.mux(packet)
        for packet in stream.encode(None):
            c.mux(packet)
    return out.getvalue()


def pieces(data: bytes, seed: int, most: int = 3000) -> list[bytes]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(data):
        n = rng.randint(1, most)
        out.append(data[i:i + n])
        i += n
    return out


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


def heard(transcripts, sentence: str) -> float:
    """Share of the sentence's words found in the transcripts."""
    said = words(" ".join(t.text for t in transcripts))
    return len(words(sentence) & said) / len(words(sentence))
