"""Incremental audio decoding: a byte stream that arrives in pieces -> 16 kHz mono float32.

Three inputs (the `format` of an audio media frame):
- `pcm_s16le`: raw interleaved 16-bit little-endian samples at a declared rate and channel count;
  a piece may end inside a sample frame (the rest is carried to the next piece);
- `opus`: an Ogg-Opus byte stream (RFC 7845). Ogg pages are framed here, each page's CRC is
  checked, and packets go to the Opus decoder; a corrupt page is skipped by resynchronising on
  the next capture pattern, so one bad piece costs only its own audio. Pre-skip is dropped
  (by FFmpeg's decoder) and the last page's granule position trims the end padding;
- `aac`: an ADTS byte stream, framed by FFmpeg's parser.

Every decoder is fed bytes and returns float32 mono samples at 16 kHz (channels averaged,
resampled by PyAV's stateful resampler, so piece boundaries change nothing). PyAV is imported
when a decoder is built, never at import time.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from .errors import MediaDecodeError, MediaHeaderInvalid, UnsupportedMedia

RATE = 16_000
FORMATS = ("pcm_s16le", "opus", "aac")
MAX_CHANNELS = 64
MAX_RATE = 384_000


def import_av() -> Any:
    try:
        import av
    except ImportError as e:  # the media extra is not installed
        raise UnsupportedMedia("audio decoding needs PyAV: install streamer[media]") from e
    return av


class Resampler:
    """Mono float32 at any rate -> mono float32 at 16 kHz, stateful across pieces."""

    def __init__(self) -> None:
        self._av = import_av()
        self._rate = 0
        self._inner = None

    def __call__(self, samples: np.ndarray, rate: int) -> np.ndarray:
        out = []
        if rate != self._rate:  # first call, or the stream changed rate (AAC may): flush the old one
            out.extend(self.flush_parts())
            self._rate = rate
            self._inner = None if rate == RATE else self._av.AudioResampler(format="flt", layout="mono", rate=RATE)
        if self._inner is None:
            out.append(samples.astype(np.float32, copy=False))
        elif len(samples):
            frame = self._av.AudioFrame.from_ndarray(np.ascontiguousarray(samples, np.float32)[None, :],
                                                     format="flt", layout="mono")
            frame.sample_rate = rate
            out.extend(f.to_ndarray()[0] for f in self._inner.resample(frame))
        return _join(out)

    def flush(self) -> np.ndarray:
        return _join(self.flush_parts())

    def flush_parts(self) -> list[np.ndarray]:
        if self._inner is None:
            return []
        parts = [f.to_ndarray()[0] for f in self._inner.resample(None)]
        self._inner = self._av.AudioResampler(format="flt", layout="mono", rate=RATE)
        return parts


def _join(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.float32, copy=False) if parts else np.zeros(0, np.float32)


def _mono(frame: Any) -> np.ndarray:
    """A decoded PyAV audio frame as float32 mono (channels averaged)."""
    x = frame.to_ndarray().astype(np.float32, copy=False)
    channels = len(frame.layout.channels)
    if not frame.format.is_planar:
        x = x.reshape(-1, channels).T
    if frame.format.name.startswith("s16"):
        x = x / 32768.0
    elif frame.format.name.startswith("s32"):
        x = x / 2147483648.0
    return x.mean(axis=0) if x.shape[0] > 1 else x[0]


class PcmDecoder:
    """Raw s16le interleaved PCM at a declared rate and channel count."""

    def __init__(self, sample_rate: int | None, channels: int | None) -> None:
        if not isinstance(sample_rate, int) or isinstance(sample_rate, bool) or not 1_000 <= sample_rate <= MAX_RATE:
            raise MediaHeaderInvalid(f"pcm_s16le needs sample_rate between 1000 and {MAX_RATE} Hz, got {sample_rate!r}")
        if not isinstance(channels, int) or isinstance(channels, bool) or not 1 <= channels <= MAX_CHANNELS:
            raise MediaHeaderInvalid(f"pcm_s16le needs channels between 1 and {MAX_CHANNELS}, got {channels!r}")
        self.sample_rate, self.channels = sample_rate, channels
        self._carry = b""
        self._resample = Resampler()
        self.out: list[np.ndarray] = []

    def feed(self, data: bytes) -> None:
        data = self._carry + data
        frame = 2 * self.channels
        whole = len(data) - len(data) % frame
        self._carry = data[whole:]
        x = np.frombuffer(data[:whole], dtype="<i2").astype(np.float32) / 32768.0
        x = x.reshape(-1, self.channels).mean(axis=1) if self.channels > 1 else x
        self.out.append(self._resample(x, self.sample_rate))

    def finish(self) -> None:
        self.out.append(self._resample.flush())
        if self._carry:
            n, self._carry = len(self._carry), b""
            raise MediaDecodeError(f"pcm_s16le stream ended inside a sample frame ({n} of {2 * self.channels} "
                                   "bytes); the partial frame was dropped")


def _ogg_crc_table() -> list[int]:
    table = []
    for i in range(256):
        r = i << 24
        for _ in range(8):
            r = ((r << 1) ^ 0x04C11DB7) if r & 0x80000000 else (r << 1)
        table.append(r & 0xFFFFFFFF)
    return table


_CRC = _ogg_crc_table()


def ogg_crc(page: bytes) -> int:
    """The Ogg page checksum (CRC-32, polynomial 0x04c11db7, unreflected, zero initial value)
    over the page with its checksum field zeroed (RFC 3533 section 6)."""
    crc = 0
    for b in page[:22] + b"\0\0\0\0" + page[26:]:
        crc = ((crc << 8) & 0xFFFFFFFF) ^ _CRC[(crc >> 24) ^ b]
    return crc


class OggPages:
    """Ogg framing (RFC 3533): bytes in, packets of the first logical stream out. Packets that
    end on the stream's last page (end-of-stream flag) come with that page's granule position,
    which tells the decoder where the stream really ends (RFC 7845 section 4.4)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._packet = bytearray()  # a packet continued across pages
        self.serial: int | None = None
        self.resyncs = 0
        self._lost = False  # skipping damage already reported, until the next good page

    def feed(self, data: bytes) -> tuple[list[tuple[bytes, int | None]], str | None]:
        """(packet, end granule or None) completed by `data`, and an error message if corrupt
        bytes were skipped."""
        self._buf += data
        packets: list[tuple[bytes, int | None]] = []
        error = None
        while True:
            start = self._buf.find(b"OggS")
            if start != 0:
                skipped = len(self._buf) if start < 0 else start
                if start < 0:  # keep a possible partial capture pattern at the end
                    skipped = max(0, len(self._buf) - 3)
                if skipped:
                    if not self._lost:
                        error = error or f"{skipped} bytes of non-Ogg data skipped"
                    self._drop(skipped)
                if start < 0:
                    return packets, error
            page = self._page()
            if page is None:
                return packets, error
            if isinstance(page, str):
                if not self._lost:
                    error = error or page
                self._drop(4)  # resynchronise on the next capture pattern
                continue
            packets.extend(page)

    def pending(self) -> int:
        """Bytes held for an incomplete page: at most one page (27 + 255 + 255 * 255 bytes)."""
        return len(self._buf)

    def _drop(self, n: int) -> None:
        self._lost = True
        del self._buf[:n]
        self._packet.clear()  # a packet spanning the damage is lost
        self.resyncs += 1

    def _page(self) -> list[tuple[bytes, int | None]] | str | None:
        """Packets of one complete page at the buffer's start, None if incomplete, or an error."""
        buf = self._buf
        if len(buf) < 27:
            return None
        version, flags, granule, serial, _seq, crc, nseg = struct.unpack_from("<BBqIIIB", buf, 4)
        if version != 0:
            return f"Ogg page version {version} is not 0"
        header = 27 + nseg
        if len(buf) < header:
            return None
        lacing = buf[27:header]
        size = header + sum(lacing)
        if len(buf) < size:
            return None
        page = bytes(buf[:size])
        if ogg_crc(page) != crc:
            return "Ogg page checksum mismatch (corrupt bytes)"
        del buf[:size]
        self._lost = False
        if self.serial is None:
            self.serial = serial
        if serial != self.serial:  # a multiplexed second stream: not ours
            return []
        if flags & 0x01 == 0:  # not a continuation: any unfinished packet was cut
            self._packet.clear()
        end = granule if flags & 0x04 and granule >= 0 else None
        packets, pos = [], header
        for lace in lacing:
            self._packet += page[pos:pos + lace]
            pos += lace
            if lace < 255:
                packets.append((bytes(self._packet), end))
                self._packet.clear()
        return packets


class OpusDecoder:
    """Ogg-Opus: OpusHead, OpusTags, then audio packets (48 kHz internally)."""

    def __init__(self) -> None:
        self._av = import_av()
        self._ogg = OggPages()
        self._codec = None
        self._decoded = 0  # samples decoded so far at 48 kHz, pre-skip included (granule units)
        self._end: int | None = None  # the last page's granule: samples beyond it are padding
        self._tags = False
        self._resample = Resampler()
        self.out: list[np.ndarray] = []

    def feed(self, data: bytes) -> None:
        packets, error = self._ogg.feed(data)
        bad = 0
        for packet, end in packets:
            self._end = end if end is not None else self._end
            bad += not self._packet(packet)
        if error is not None:
            raise MediaDecodeError(f"opus: {error}; decoding resumes at the next page")
        if bad:
            raise MediaDecodeError(f"opus: {bad} packet(s) could not be decoded and were skipped")

    def finish(self) -> None:
        if self._codec is not None:
            self.out.extend(self._pcm(f) for f in self._codec.decode(None))
        self.out.append(self._resample.flush())
        n = self._ogg.pending()
        if n:
            self._ogg = OggPages()
            raise MediaDecodeError(f"opus stream ended inside an Ogg page ({n} bytes truncated)")

    def _packet(self, packet: bytes) -> bool:
        """Decode one packet into `out`; False if the decoder refused it."""
        if self._codec is None:
            self._open(packet)
            return True
        if not self._tags:
            self._tags = packet.startswith(b"OpusTags")
            if self._tags:
                return True
        try:
            frames = self._codec.decode(self._av.Packet(packet))
        except self._av.error.FFmpegError:
            return False
        self.out.extend(self._pcm(f) for f in frames)
        return True

    def _open(self, head: bytes) -> None:
        if not head.startswith(b"OpusHead") or len(head) < 19:
            raise UnsupportedMedia(f"the Ogg stream is not Opus (first packet starts {head[:8]!r}); send Ogg-Opus, "
                                   "ADTS AAC or pcm_s16le")
        # FFmpeg's decoders read the pre-skip from OpusHead and drop those samples themselves
        # (RFC 7845 section 4.2); they still count in granule positions.
        self._decoded = struct.unpack_from("<H", head, 10)[0]
        codec = self._av.CodecContext.create("libopus" if "libopus" in self._av.codecs_available else "opus", "r")
        codec.extradata = head
        self._codec = codec

    def _pcm(self, frame: Any) -> np.ndarray:
        x = _mono(frame)
        scale = frame.sample_rate / 48_000  # granules count 48 kHz samples
        if self._end is not None:  # end trimming on the last page
            x = x[:max(0, round((self._end - self._decoded) * scale))]
        self._decoded += round(frame.samples / scale)
        return self._resample(x, frame.sample_rate)


class AdtsDecoder:
    """ADTS AAC through FFmpeg's parser (which finds frame boundaries in any piece sizes)."""

    def __init__(self) -> None:
        self._av = import_av()
        self._codec = self._av.CodecContext.create("aac", "r")
        self._resample = Resampler()
        self.out: list[np.ndarray] = []

    def feed(self, data: bytes) -> None:
        bad = 0
        for packet in self._codec.parse(data):
            try:
                frames = self._codec.decode(packet)
            except self._av.error.FFmpegError:
                bad += 1
                continue
            self.out.extend(self._resample(_mono(f), f.sample_rate) for f in frames)
        if bad:
            raise MediaDecodeError(f"aac (ADTS): {bad} frame(s) could not be decoded and were skipped")

    def finish(self) -> None:
        try:
            self.feed(b"")
        finally:
            self.out.append(self._resample.flush())


def take(decoder) -> np.ndarray:
    """The samples a decoder produced since the last take (also those before an error)."""
    out, decoder.out = decoder.out, []
    return _join(out)


def make_decoder(fmt: str, sample_rate: int | None = None, channels: int | None = None):
    """The decoder for an audio `format`; UnsupportedMedia for anything else."""
    if fmt == "pcm_s16le":
        return PcmDecoder(sample_rate, channels)
    if fmt == "opus":
        return OpusDecoder()
    if fmt == "aac":
        return AdtsDecoder()
    raise UnsupportedMedia(f"audio format {fmt!r} is not supported; use one of {', '.join(FORMATS)}")
