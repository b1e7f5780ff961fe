"""The video path without a model: incremental decode, sampling, dedup, newest frame wins, the
frame describer, and clear errors for bad bytes."""

from __future__ import annotations

import random
import re
import time

import numpy as np
import pytest

pytest.importorskip("av")

from streamer.vision.describe import FrameDescriber  # noqa: E402
from streamer.vision.encoder import Frame  # noqa: E402
from streamer.vision.errors import MediaDecodeError, MediaTooLarge, UnsupportedMedia  # noqa: E402
from streamer.vision.video import DecodeLimits, FrameSampler, LatestSlot, VideoDecoder, decode_image  # noqa: E402

from videogen import encode_audio_only, encode_image, encode_video, scene_frame  # noqa: E402

FORMATS = ["mp4", "webm", "mpegts"]


@pytest.fixture(scope="module", params=FORMATS)
def video(request):
    return request.param, encode_video(request.param)


def decode_pieces(fmt: str, data: bytes, rng: random.Random | None = None, max_piece: int = 3000):
    decoder = VideoDecoder(fmt)
    frames, i = [], 0
    while i < len(data):
        n = rng.randint(1, max_piece) if rng else len(data)
        frames += decoder.feed(data[i:i + n])
        i += n
    frames += decoder.finish()
    decoder.check()
    return frames


def describe(frames):
    kept = FrameSampler(2.0).filter(frames)
    return FrameDescriber().encode(kept)


def test_scene_cuts_appear_at_their_timestamps(video):
    fmt, data = video
    frames = decode_pieces(fmt, data)
    assert len(frames) == 60 and frames[0].pts == 0.0 and abs(frames[-1].pts - 5.9) < 1e-6
    observations = describe(frames)
    cuts = [o.start_s for o in observations if "scene_cut" in o.events]
    assert cuts == pytest.approx([2.0, 4.0], abs=1e-6)
    assert observations[0].start_s == 0.0 and "start" in observations[0].events
    colours = {round(o.start_s): o.text for o in observations if o.events[0] in ("start", "scene_cut")}
    assert "red" in colours[0] and "blue" in colours[2] and "green" in colours[4]
    assert "[video 2.0s] scene cut" in colours[2]


@pytest.mark.parametrize("seed", [1, 2])
def test_random_pieces_give_the_whole_file_result(video, seed):
    fmt, data = video
    whole = decode_pieces(fmt, data)
    pieces = decode_pieces(fmt, data, random.Random(seed), max_piece=700 if fmt != "mpegts" else 4000)
    assert [f.pts for f in pieces] == [f.pts for f in whole]
    assert all(np.array_equal(a.image, b.image) for a, b in zip(pieces, whole))
    assert [o.text for o in describe(pieces)] == [o.text for o in describe(whole)]


def write_pieces(fmt: str, data: bytes, rng: random.Random, max_piece: int):
    """The non-blocking path: each piece is written when the decoder has used the one before
    (from `then`, on the decoder's thread), frames come out through `on_frame`; per piece, the
    frames it completed and the thread its `then` ran on."""
    import threading

    frames, per_piece, done = [], [], threading.Event()
    cuts = [0]
    while cuts[-1] < len(data):
        cuts.append(min(len(data), cuts[-1] + rng.randint(1, max_piece)))
    decoder = VideoDecoder(fmt, on_frame=frames.append)

    def piece(k: int) -> None:
        if k:
            per_piece.append((len(frames), threading.current_thread().name))
        if k == len(cuts) - 1:
            decoder.end(b"", lambda: (per_piece.append((len(frames), threading.current_thread().name)), done.set()))
        else:
            decoder.write(data[cuts[k]:cuts[k + 1]], lambda: piece(k + 1))

    piece(0)
    assert done.wait(60), "the decoder did not finish"
    decoder.check()
    return frames, per_piece


@pytest.mark.parametrize("seed", [1, 2])
def test_written_pieces_give_the_frames_fed_pieces_give(video, seed):
    fmt, data = video
    whole = decode_pieces(fmt, data)
    frames, per_piece = write_pieces(fmt, data, random.Random(seed), max_piece=700 if fmt != "mpegts" else 4000)
    assert [f.pts for f in frames] == [f.pts for f in whole]
    assert all(np.array_equal(a.image, b.image) for a, b in zip(frames, whole))
    counts = [n for n, _ in per_piece]
    assert counts == sorted(counts) and counts[-1] == len(whole)
    assert {name for _, name in per_piece} == {f"demux-{fmt}"}  # no other thread waited for a piece


def test_work_handed_to_the_decoder_runs_on_its_thread_and_at_its_stop():
    import threading

    data = encode_video("mpegts", seconds=1.0)
    decoder = VideoDecoder("mpegts", on_frame=lambda f: None)
    used, ran = threading.Event(), []
    decoder.write(data[:1000], used.set)
    assert used.wait(30)
    assert decoder.call(lambda: ran.append(threading.current_thread().name))  # the decoder waits for bytes
    stopped = threading.Event()
    decoder.end(data[1000:], stopped.set)
    assert stopped.wait(30)
    assert ran == ["demux-mpegts"]
    assert not decoder.call(lambda: ran.append("late"))  # stopped: not taken
    assert ran == ["demux-mpegts"]


def test_frames_arrive_while_the_stream_is_still_coming():
    data = encode_video("mp4", seconds=4.0)
    decoder = VideoDecoder("mp4")
    cut = len(data) * 3 // 4
    half = decoder.feed(data[:cut])
    assert 0 < len(half) < 40  # decoded before the rest of the bytes exist
    rest = decoder.feed(data[cut:]) + decoder.finish()
    assert len(half) + len(rest) == 40


def test_describer_is_honest_about_what_it_sees(video):
    fmt, data = video
    lines = [o.text for o in describe(decode_pieces(fmt, data))]
    assert "no object recognition" in lines[0]
    grammar = re.compile(r"^\[video \d+\.\ds\] (video starts \(frame statistics only: colours, brightness, motion; "
                         r"no object recognition\); |scene cut; )?colours: [a-z]+ \d+%(, [a-z]+ \d+%)*; "
                         r"brightness (dark|dim|moderate|bright)(; motion (none|low|moderate|high))?\.\n$")
    assert all(grammar.match(line) for line in lines), lines


def test_still_frames_are_skipped_as_duplicates_with_a_heartbeat():
    still = np.full((48, 64, 3), 90, np.uint8)
    frames = [Frame(still.copy(), i * 0.5, i * 0.5, i) for i in range(41)]  # 20 s of a still camera
    sampler = FrameSampler(2.0, heartbeat_s=10.0)
    kept = sampler.filter(frames)
    assert [f.pts for f in kept] == [0.0, 10.0, 20.0]
    assert sampler.stats.duplicates == 38
    assert len(FrameSampler(2.0, heartbeat_s=0).filter(frames)) == 1


def test_sampler_keeps_one_frame_per_slot():
    frames = [Frame(scene_frame(i / 30), i / 30, i / 30, i) for i in range(90)]  # 3 s at 30 fps
    kept = FrameSampler(2.0, dup_threshold=0.0).filter(frames)
    assert [round(f.pts, 3) for f in kept] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]


def test_newest_frame_wins_when_the_consumer_is_behind():
    slot = LatestSlot()
    frames = [Frame(np.zeros((2, 2, 3), np.uint8), i, i, i) for i in range(5)]
    for f in frames:
        slot.put(f)
    assert slot.get().index == 4 and slot.dropped == 4
    slot.close()
    assert slot.get() is None


@pytest.mark.parametrize("fmt", ["jpeg", "png"])
def test_single_images(fmt):
    image = scene_frame(2.5)
    frame = decode_image(fmt, encode_image(fmt, image), ts=12.0)
    assert frame.image.shape == image.shape and frame.ts == 12.0
    assert np.abs(frame.image.astype(int) - image).mean() < 8
    with pytest.raises(MediaDecodeError, match=fmt):
        decode_image(fmt, encode_image(fmt, image)[:40], ts=0.0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_corrupt_and_truncated_bytes_raise_decode_errors(fmt):
    rng = random.Random(3)
    for bad in (bytes(rng.randrange(256) for _ in range(5000)), encode_video(fmt)[:100], b"\x00" * 10):
        decoder = VideoDecoder(fmt)
        frames = decoder.feed(bad) + decoder.finish()
        with pytest.raises(MediaDecodeError, match=fmt):
            decoder.check()
        assert frames == []


def test_corrupt_bytes_mid_stream_keep_the_frames_before():
    data = bytearray(encode_video("mp4"))
    start = len(data) // 3
    data[start:start + 400] = bytes((b * 7 + 13) % 256 for b in data[start:start + 400])
    decoder = VideoDecoder("mp4")
    frames = decoder.feed(bytes(data)) + decoder.finish()
    with pytest.raises(MediaDecodeError, match="corrupt after frame"):
        decoder.check()
    assert 0 < len(frames) < 60


def test_a_stream_without_video_is_unsupported():
    decoder = VideoDecoder("mpegts")
    decoder.feed(encode_audio_only())
    decoder.finish()
    with pytest.raises(UnsupportedMedia, match="no video track"):
        decoder.check()
    with pytest.raises(UnsupportedMedia, match="avi"):
        VideoDecoder("avi")


def test_a_picture_too_large_is_refused():
    decoder = VideoDecoder("mp4", limits=DecodeLimits(max_pixels=64 * 64))
    decoder.feed(encode_video("mp4", seconds=1.0))
    decoder.finish()
    with pytest.raises(MediaTooLarge, match="128x96"):
        decoder.check()
    with pytest.raises(MediaTooLarge):
        decode_image("png", encode_image("png", scene_frame(0)), 0.0, limits=DecodeLimits(max_pixels=100))


def test_a_colour_change_at_equal_brightness_is_not_a_duplicate():
    red, green = np.zeros((48, 64, 3), np.uint8), np.zeros((48, 64, 3), np.uint8)
    red[..., 0], green[..., 1] = 200, 102  # the same luma: 0.299 * 200 = 0.587 * 102
    sampler = FrameSampler(2.0)
    assert sampler.filter([Frame(red, 0.0, 0.0, 0), Frame(green, 0.5, 0.5, 1)]) != []
    assert sampler.stats.sampled == 2 and sampler.stats.duplicates == 0


def test_a_long_stream_holds_bounded_memory():
    """Ten minutes of video through decode -> sampling -> describer in pieces: the Python heap
    (numpy frames included, via tracemalloc) does not grow with the length of the stream."""
    import tracemalloc

    scenes = [(float(t), ((t * 67) % 256, (t * 131) % 256, (t * 29) % 256)) for t in range(0, 600, 3)]
    data = encode_video("mpegts", seconds=600.0, fps=4, scenes=scenes, size=(48, 64))
    decoder, sampler, describer = VideoDecoder("mpegts"), FrameSampler(2.0), FrameDescriber()
    piece, marks, lines = 16384, {}, 0
    tracemalloc.start()
    try:
        for k, i in enumerate(range(0, len(data), piece)):
            lines += len(describer.encode(sampler.filter(decoder.feed(data[i:i + piece]))))
            if k % 20 == 0:
                marks[i / len(data)] = tracemalloc.get_traced_memory()[0]
        lines += len(describer.encode(sampler.filter(decoder.finish())))
    finally:
        tracemalloc.stop()
    decoder.check()
    assert decoder.decoded == 2400 and describer.cuts >= 190 and lines >= 200
    early = max(v for f, v in marks.items() if 0.1 <= f < 0.3)
    late = max(v for f, v in marks.items() if f >= 0.7)
    assert late - early < 256 * 1024, (early, late)


def test_a_live_source_at_the_sample_rate_keeps_every_frame_despite_jitter():
    rng = random.Random(4)
    pts = [k * 0.5 + rng.uniform(-0.06, 0.06) for k in range(1, 60)]
    frames = [Frame(scene_frame(k), max(0.0, t), t, k) for k, t in enumerate([0.0, *pts])]
    sampler = FrameSampler(2.0, dup_threshold=0.0)
    assert len(sampler.filter(frames)) == 60
    faster = [Frame(scene_frame(k), k / 3, k / 3, k) for k in range(30)]  # 3 fps in, 2 fps out
    assert len(FrameSampler(2.0, dup_threshold=0.0).filter(faster)) == 20


@pytest.mark.parametrize("fmt", ["mp4", "webm", "mpegts"])
def test_any_single_cut_decodes_every_frame(fmt):
    """A stream cut in two anywhere (inside the MP4 header's atoms too) gives every frame:
    an MP4 atom split across reads once made FFmpeg's demuxer stop without an error."""
    from streamer.vision.video import VideoDecoder

    data = encode_video(fmt)
    for cut in range(1, min(len(data), 2000), 13):
        decoder = VideoDecoder(fmt)
        frames = decoder.feed(data[:cut]) + decoder.feed(data[cut:]) + decoder.finish()
        decoder.check()
        assert len(frames) == 60, (fmt, cut, len(frames))


def test_a_watched_decoder_that_stalls_fails_its_piece():
    import threading

    decoder = VideoDecoder("mpegts", limits=DecodeLimits(stall_s=0.05), on_frame=lambda f: None)
    data = encode_video("mpegts", seconds=1.0)
    used = threading.Event()
    decoder.write(data[:1000], used.set)
    assert used.wait(30)
    time.sleep(0.1)
    assert not decoder.stalled()  # it waits for bytes: not a stall
    gate = threading.Event()
    assert decoder.call(gate.wait)  # the decoder's thread is stuck, as one inside FFmpeg would be
    failed, looks = threading.Event(), []

    def later(seconds, fn):
        looks.append(seconds)
        threading.Timer(seconds, fn).start()

    try:
        decoder.write(data[1000:2000], failed.set)
        decoder.watch(failed.is_set, later)
        assert failed.wait(30) and looks
        with pytest.raises(MediaDecodeError, match="stalled"):
            decoder.check()
    finally:
        gate.set()
        decoder.close()
