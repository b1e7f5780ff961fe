"""The vision-language path: Qwen2.5-VL reading a live stream of frames and text into one cache.

Each frame is resized to fit a visual-token budget, cut into the model's patches
(`vlm_patches.py`: numpy/torch, since transformers' fast image processor needs torchvision,
which does not import beside this torch build), encoded by the model's vision tower, and its embeddings are prefilled into the
stream's KV cache between `<|vision_start|>` and `<|vision_end|>`. Text appended between frames
goes into the same cache. The language model runs through the project's attention hook
(`streamer.sessions.runner`): new keys and values are written into a `KVCache` at explicit
slots, with explicit 3-D M-RoPE positions that continue from chunk to chunk exactly as the
model's own `get_rope_index` numbers one long multimodal sequence. So appending frames and text
one by one gives the logits of one forward over everything (tests/vision/test_vlm.py).

Positions (Qwen2.5-VL M-RoPE): a text token at position p has (t, h, w) = (p, p, p); a frame
whose merged grid is gh x gw starting at p has t = p, h = p + row, w = p + col, and the next
token starts at p + max(gh, gw). Frames are fed as still images, one grid each.

Bounded memory (`Window`, after StreamingVLM): attention sinks (the first tokens of the stream),
a recent window of frames and a longer window of text. Room is made before a chunk is
prefilled: the oldest frames and the oldest text beyond their windows are evicted. Then the
positions are re-anchored: the kept spans are packed one after another, and each moved span's
cached keys are rotated back by its shift. A uniform shift of all three M-RoPE components is an
ordinary RoPE rotation (every frequency turns by shift x inv_freq, whichever component feeds
it), so rotating a cached key equals computing it at the new position, and relative positions
inside a span are kept. After re-anchoring the largest position is below the cache length, so
the stream never runs past the model's position range however long it runs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from streamer.sessions.errors import ContextOverflow
from streamer.sessions.framing import Framing
from streamer.sessions.kvcache import KVCache, KVShape
from streamer.sessions.rope import rotate_keys
from streamer.sessions.runner import ATTENTION_NAME, SeqStep, StepMetadata, register_attention
from streamer.sessions.sampling import stop_token_ids

from .encoder import Frame, Observation, VisionEncoder
from .errors import MediaTooLarge
from .vlm_patches import PatchSpec, fit_size, patchify

__all__ = ["PatchSpec", "QwenVLEncoder", "TinyVLMConfig", "VLMStream", "Window", "build_tiny_vlm",
           "fit_size", "load_vlm", "patchify", "vlm_encoder_factory", "vlm_factory_from_spec"]

log = logging.getLogger(__name__)

VIDEO_SYSTEM_PROMPT = (
    "You are a helpful assistant. The user streams video frames to you as they are captured. "
    "Answer questions about what you have seen briefly and accurately."
)


# ---------------------------------------------------------------------------------------------
# the stream: one cache of frames and text


@dataclass(frozen=True, slots=True)
class Window:
    """Bounded memory for an unbounded stream. The committed cache never holds more than
    `bound` tokens: sink spans (everything that began within the first `sink_tokens`), at most
    `vision_tokens` of recent frames and `text_tokens` of recent text, plus one incoming frame
    of up to `frame_tokens` (its visual tokens and two markers). `query_tokens` more are kept
    free for questions (a question and its answer, read as a fork past the committed cache)."""

    sink_tokens: int = 64
    vision_tokens: int = 1024
    text_tokens: int = 2048
    query_tokens: int = 256

    def __post_init__(self) -> None:
        if min(self.sink_tokens, self.query_tokens) < 0 or self.text_tokens < 1:
            raise ValueError(f"window sizes must be >= 0 (text window >= 1), got {self}")

    def bound(self, frame_tokens: int) -> int:
        return self.sink_tokens + frame_tokens + 2 + self.vision_tokens + self.text_tokens


@dataclass(slots=True)
class Span:
    """A run of cached tokens from one input: a frame (with its markers) or a piece of text.
    `positions` `[3, length]` are the M-RoPE (t, h, w) positions its keys were rotated with;
    `extent` is how far it advances the position counter."""

    kind: str  # "frame" | "text"
    start: int
    positions: torch.Tensor
    extent: int
    pinned: bool = False
    ts: float | None = None

    @property
    def length(self) -> int:
        return self.positions.shape[1]

    @property
    def base(self) -> int:
        return int(self.positions[0, 0])


@dataclass(slots=True)
class StreamStats:
    frames: int = 0
    visual_tokens: int = 0
    text_tokens: int = 0
    evicted_frames: int = 0
    evicted_text_tokens: int = 0
    reanchors: int = 0
    max_position: int = -1


class VLMStream:
    """A Qwen2.5-VL model reading frames and text into one growing (or bounded) KV cache.

    Not thread-safe: one thread drives it. `window=None` keeps everything (exact, grows until
    `max_tokens`); a `Window` bounds the cache and re-anchors positions (see the module doc).
    """

    def __init__(self, model: torch.nn.Module, tokenizer=None, *, frame_tokens: int = 256,
                 window: Window | None = None, max_tokens: int | None = None,
                 system_prompt: str | None = None) -> None:
        register_attention()
        if model.config.text_config._attn_implementation != ATTENTION_NAME:  # shared models: set once
            model.set_attn_implementation({"text_config": ATTENTION_NAME})
        model.eval()
        self.model = model
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt if system_prompt is not None else VIDEO_SYSTEM_PROMPT
        cfg = model.config
        self.text_config = cfg.text_config
        self.lm = model.model.language_model
        self.spec = PatchSpec.from_config(cfg.vision_config)
        self.image_token_id = cfg.image_token_id
        self.vision_start_id = cfg.vision_start_token_id
        self.vision_end_id = cfg.vision_end_token_id
        self.max_positions = int(self.text_config.max_position_embeddings)
        if frame_tokens < 1:
            raise ValueError(f"frame_tokens must be at least 1, got {frame_tokens}")
        self.frame_tokens = frame_tokens
        self.window = window
        self.bound, limit = self._limits(max_tokens)
        param = next(model.parameters())
        tc = self.text_config
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        shape = KVShape(layers=tc.num_hidden_layers, kv_heads=tc.num_key_value_heads, head_dim=head_dim,
                        dtype=param.dtype, device=param.device)
        self.device = param.device
        self.cache = KVCache(shape, limit)
        self.spans: list[Span] = []
        self.next_pos = 0
        self.stats = StreamStats()
        self.logits: torch.Tensor | None = None  # next-token logits after the last append

    def _limits(self, max_tokens: int | None) -> tuple[int, int]:
        """(committed tokens the stream may hold, cache capacity including question room)."""
        window = self.window
        if window is None:
            limit = max_tokens or self.max_positions
            if limit > self.max_positions:
                raise ValueError(f"max_tokens {limit} exceeds the model's {self.max_positions} positions")
            return limit, limit
        if window.vision_tokens < self.frame_tokens + 2:
            raise ValueError(f"vision window of {window.vision_tokens} tokens cannot hold one "
                             f"frame of {self.frame_tokens} (+2 markers)")
        bound = window.bound(self.frame_tokens)
        if bound + window.query_tokens > self.max_positions:
            raise ValueError(f"window bound {bound} + {window.query_tokens} query tokens exceeds "
                             f"the model's {self.max_positions} positions")
        return bound, bound + window.query_tokens

    # -- appends ---------------------------------------------------------------------------

    def append_tokens(self, ids: Sequence[int], ts: float | None = None) -> torch.Tensor:
        """Append text tokens; returns the next-token logits. With a window, the part within the
        sink budget is pinned, and text longer than the text window is read in window-sized
        pieces (older pieces are evicted as it goes)."""
        ids = [int(i) for i in ids]
        if not ids:
            raise ValueError("append_tokens needs at least one token")
        for piece in self._text_pieces(ids):
            self._append_text_piece(piece, ts)
        return self.logits

    def _text_pieces(self, ids: list[int]) -> list[list[int]]:
        if self.window is None:
            return [ids]
        sink = max(0, self.window.sink_tokens - self.cache.length)
        head, rest = ids[:sink], ids[sink:]
        step = self.window.text_tokens
        return ([head] if head else []) + [rest[i:i + step] for i in range(0, len(rest), step)]

    def append_text(self, text: str, ts: float | None = None) -> torch.Tensor:
        """Append text, tokenized on its own (never with earlier text)."""
        return self.append_tokens(self._tokenize(text), ts)

    def _tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this stream has no tokenizer; append token ids instead")
        return self.tokenizer.encode(text, add_special_tokens=False)

    def append_image(self, image: np.ndarray, ts: float | None = None, label: str | None = None) -> int:
        """Append one RGB uint8 frame `[H, W, 3]`, resized to fit the per-frame budget, after an
        optional text `label` (a timestamp, say; needs the tokenizer). Returns the visual tokens
        it took (markers not counted). A frame that cannot be used changes nothing."""
        pixels, grid = patchify(image, self.frame_tokens, self.spec)
        embeds = self.encode_pixels(pixels, grid)
        n = embeds.shape[0]
        label_ids = self._tokenize(label) if label else []
        if self.window is None and self.cache.length + len(label_ids) + n + 2 > self.bound:
            raise ContextOverflow(f"a frame of {n} tokens does not fit the stream's cache ({self.cache.length} "
                                  f"of {self.bound} used); open it with a window for unbounded input")
        if label_ids:
            self.append_tokens(label_ids, ts)
        start_emb, end_emb = self._embed([self.vision_start_id, self.vision_end_id])
        inputs = torch.cat([start_emb[None], embeds, end_emb[None]])
        self._make_room("frame", n + 2)
        p = self.next_pos
        m = self.spec.merge_size
        gh, gw = grid[1] // m, grid[2] // m
        rows = torch.arange(gh).repeat_interleave(gw)
        cols = torch.arange(gw).repeat(gh)
        vision = torch.stack([torch.zeros(n, dtype=torch.long), rows, cols]) + (p + 1)
        positions = torch.cat([torch.full((3, 1), p), vision, torch.full((3, 1), p + 1 + max(gh, gw))], 1)
        self._prefill("frame", inputs, positions, extent=max(gh, gw) + 2, ts=ts)
        self.stats.frames += 1
        self.stats.visual_tokens += n
        return n

    @torch.inference_mode()
    def encode_pixels(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """Vision-tower embeddings `[tokens, hidden]` of one patchified frame."""
        param = next(self.model.parameters())
        grid_thw = torch.tensor([grid], device=self.device)
        out = self.model.model.get_image_features(pixels.to(self.device, param.dtype), grid_thw)
        return torch.cat(out.pooler_output).to(param.dtype)

    def _append_text_piece(self, ids: list[int], ts: float | None) -> None:
        self._make_room("text", len(ids))
        positions = torch.arange(self.next_pos, self.next_pos + len(ids)).expand(3, -1)
        self._prefill("text", self._embed(ids), positions, extent=len(ids), ts=ts)
        self.stats.text_tokens += len(ids)

    def _embed(self, ids: Sequence[int]) -> torch.Tensor:
        with torch.inference_mode():
            return self.lm.embed_tokens(torch.tensor(list(ids), device=self.device))

    @torch.inference_mode()
    def _forward(self, inputs: torch.Tensor, positions: torch.Tensor, start: int) -> torch.Tensor:
        """Run `inputs` `[n, hidden]` at cache slots `[start, start + n)`; next-token logits of the
        last one. The caller commits (or not: a fork)."""
        n = inputs.shape[0]
        self.cache.reserve(start + n)
        meta = StepMetadata([SeqStep(self.cache, start, range(n))])
        out = self.lm(inputs_embeds=inputs[None], position_ids=positions[:, None, :].to(self.device),
                      use_cache=False, streamer_meta=meta)
        return self.model.lm_head(out.last_hidden_state[:, -1])[0].float()

    def _prefill(self, kind: str, inputs: torch.Tensor, positions: torch.Tensor, extent: int,
                 ts: float | None) -> None:
        start = self.cache.length
        self.logits = self._forward(inputs, positions, start)
        self.cache.commit(start + inputs.shape[0])
        pinned = self.window is not None and start < self.window.sink_tokens
        self.spans.append(Span(kind, start, positions.clone(), extent, pinned, ts))
        self.next_pos += extent
        self.stats.max_position = max(self.stats.max_position, int(positions.max()))

    # -- questions -------------------------------------------------------------------------

    def generate(self, ids: Sequence[int], max_new_tokens: int = 16,
                 stop_ids: frozenset[int] = frozenset()) -> list[int]:
        """Greedy answer to prompt tokens, read as a fork past the committed cache: the stream is
        left exactly as it was (nothing committed, positions untouched). Stops after a token in
        `stop_ids` (kept in the result) or `max_new_tokens`."""
        ids = [int(i) for i in ids]
        if not ids:
            raise ValueError("generate needs prompt tokens")
        start, pos = self.cache.length, self.next_pos
        if start + len(ids) + max_new_tokens > self.cache.max_tokens:
            raise ContextOverflow(f"a question of {len(ids)} tokens with up to {max_new_tokens} answer "
                                  f"tokens does not fit after {start} cached tokens "
                                  f"(cache of {self.cache.max_tokens})")
        logits = self._forward(self._embed(ids), torch.arange(pos, pos + len(ids)).expand(3, -1), start)
        out: list[int] = []
        while len(out) < max_new_tokens:
            token = int(logits.argmax())
            out.append(token)
            if token in stop_ids or len(out) == max_new_tokens:
                break
            at = len(ids) + len(out) - 1
            logits = self._forward(self._embed([token]), torch.full((3, 1), pos + at), start + at)
        self.cache.trim()
        return out

    def ask(self, question: str, max_new_tokens: int = 64) -> str:
        """Answer a question about what the stream has read, framed by the tokenizer's chat
        template (it closes the data turn that `data_prompt` opened, adds the question turn and
        the assistant header); greedy, as a fork, so the stream is untouched."""
        if self.tokenizer is None:
            raise ValueError("this stream has no tokenizer; use generate() with token ids")
        framing = Framing.for_tokenizer(self.tokenizer, self.system_prompt)
        ids = self.tokenizer.encode(framing.question_text(question), add_special_tokens=False)
        out = self.generate(ids, max_new_tokens, stop_token_ids(self.tokenizer, self.model))
        return self.tokenizer.decode(out, skip_special_tokens=True).strip()

    def data_prompt(self) -> str:
        """The system prompt and the open user turn that frames and questions read into."""
        if self.tokenizer is None:
            raise ValueError("this stream has no tokenizer")
        return Framing.for_tokenizer(self.tokenizer, self.system_prompt).prefix

    # -- bounded memory --------------------------------------------------------------------

    @torch.inference_mode()  # the cache buffers are inference tensors (grown inside forwards)
    def _make_room(self, kind: str, n: int) -> None:
        """Evict before prefilling `n` tokens of `kind`, then re-anchor positions."""
        if self.window is None:
            if self.cache.length + n > self.bound:
                raise ContextOverflow(f"{n} more tokens do not fit the stream's cache ({self.cache.length} "
                                      f"of {self.bound} used); open it with a window for unbounded input")
            return
        limit = self.window.vision_tokens if kind == "frame" else self.window.text_tokens
        spans = [s for s in self.spans if s.kind == kind and not s.pinned]
        held = sum(s.length for s in spans)
        drop: list[tuple[int, int]] = []
        for span in spans:
            if held + n <= limit:
                break
            cut = span.length if kind == "frame" else min(span.length, held + n - limit)
            drop.append((span.start, span.start + cut))
            held -= cut
            if kind == "frame":
                self.stats.evicted_frames += 1
            else:
                self.stats.evicted_text_tokens += cut
        if drop:
            self._evict(drop)
            self._reanchor()
            log.debug("evicted %d %s range(s) before %d new tokens; next position %d, cache %d/%d",
                      len(drop), kind, n, self.next_pos, self.cache.length, self.bound)

    def _evict(self, ranges: list[tuple[int, int]]) -> None:
        for start, end in sorted(ranges, reverse=True):
            self.cache.remove(start, end)
        kept: list[Span] = []
        for span in self.spans:
            cut = sum(min(e, span.start + span.length) - max(s, span.start)
                      for s, e in ranges if s < span.start + span.length and e > span.start)
            if cut == span.length:
                continue
            if cut:  # the oldest tokens of a text span went
                span.positions = span.positions[:, cut:]
                span.extent -= cut
            kept.append(span)
        slot = 0
        for span in kept:
            span.start = slot
            slot += span.length
        self.spans = kept

    def _reanchor(self) -> None:
        """Pack the kept spans' positions one after another and rotate each moved span's keys by
        its shift, so the largest position stays below the cache length."""
        pos = 0
        inv_freq = self.lm.rotary_emb.inv_freq.to(torch.float64)
        for span in self.spans:
            shift = span.base - pos
            if shift:
                rotate_keys(self.cache, span.start, span.length, -shift, inv_freq)
                span.positions = span.positions - shift
            pos += span.extent
        self.next_pos = pos
        self.stats.reanchors += 1

    # -- state -----------------------------------------------------------------------------

    def positions(self) -> torch.Tensor:
        """The (t, h, w) positions `[3, length]` of every cached token, in slot order."""
        if not self.spans:
            return torch.empty((3, 0), dtype=torch.long)
        return torch.cat([s.positions for s in self.spans], 1)

    def state(self) -> dict:
        s = self.stats
        frames = [sp.ts for sp in self.spans if sp.kind == "frame" and sp.ts is not None]
        return {"frames": s.frames, "visual_tokens": s.visual_tokens, "text_tokens": s.text_tokens,
                "cache_tokens": self.cache.length, "cache_bound": self.bound,
                "next_position": self.next_pos, "max_positions": self.max_positions,
                "evicted_frames": s.evicted_frames, "evicted_text_tokens": s.evicted_text_tokens,
                "reanchors": s.reanchors, "frame_tokens": self.frame_tokens,
                "window_from_ts": min(frames, default=None), "window_to_ts": max(frames, default=None)}


# ---------------------------------------------------------------------------------------------
# the VisionEncoder for a session's video stream


class QwenVLEncoder(VisionEncoder):
    """`VisionEncoder` over a `VLMStream`: each frame's vision embeddings go into the stream's
    own cache (nothing for the text session to append). With a tokenizer, each frame is
    preceded by its media time as text (`[12.5s] `), so questions can be about when."""

    name = "qwen2.5-vl"
    appends_text = False

    def __init__(self, stream: VLMStream, max_pixels: int = 4096 * 4096, timestamps: bool | None = None) -> None:
        self.stream = stream
        self.max_pixels = max_pixels
        self.timestamps = stream.tokenizer is not None if timestamps is None else timestamps

    def encode(self, frames: Sequence[Frame]) -> list[Observation]:
        out = []
        for frame in frames:
            if frame.height * frame.width > self.max_pixels:
                raise MediaTooLarge(f"frame of {frame.width}x{frame.height} pixels exceeds "
                                    f"{self.max_pixels} pixels")
            evicted = self.stream.stats.evicted_frames
            label = f"[{frame.pts:.1f}s] " if self.timestamps else None
            tokens = self.stream.append_image(frame.image, ts=frame.ts, label=label)
            events = ["evicted"] if self.stream.stats.evicted_frames > evicted else []
            out.append(Observation(start_s=frame.pts, end_s=frame.pts, ts=frame.ts, tokens=tokens,
                                   frames=[frame.index], events=events))
        return out

    def state(self) -> dict:
        return {"encoder": self.name, **self.stream.state()}

    def close(self) -> None:
        self.stream.cache.release()
        self.stream.spans.clear()


class EngineFrameEncoder(VisionEncoder):
    """The video path of a session on an engine whose model is a VLM: each frame is patched and
    run through the model's vision tower on the stream's thread, then read into the session's
    own reading cache by the engine (`append_frame`: a prefill job of embeddings, batched with
    other sessions), preceded by its media time as text (`[12.5s] `). `encode` returns when the
    frame is in the cache, so the stream's newest-frame-wins slot drops frames while the engine
    is behind. `engine` is the media path's logged engine (frames are logged as blobs)."""

    name = "engine-vl"
    appends_text = False

    def __init__(self, engine, session_id: str, frame_tokens: int = 256, max_pixels: int = 4096 * 4096) -> None:
        self.engine = engine
        self.session_id = session_id
        self.frame_tokens = frame_tokens
        self.max_pixels = max_pixels
        self.runner = engine.runner
        self.frames = 0
        self.visual_tokens = 0

    def encode(self, frames: Sequence[Frame]) -> list[Observation]:
        from streamer.sessions.multimodal import frame_input

        out = []
        for frame in frames:
            if frame.height * frame.width > self.max_pixels:
                raise MediaTooLarge(f"frame of {frame.width}x{frame.height} pixels exceeds {self.max_pixels} pixels")
            label = f"[{frame.pts:.1f}s] "
            item = frame_input(self.runner.vl, frame.image, self.frame_tokens, self.runner.tokenize(label), frame.pts)
            result = self.engine.append_frame(self.session_id, item, f"[frame {frame.pts:.2f}s]",
                                              frame_tokens=self.frame_tokens, label=label).result()
            self.frames += 1
            self.visual_tokens += item.visual_tokens
            out.append(Observation(start_s=frame.pts, end_s=frame.pts, ts=frame.ts, tokens=item.visual_tokens,
                                   frames=[frame.index], events=["evicted"] if result.evicted_seqs else [],
                                   appended=result))
        return out

    def state(self) -> dict:
        return {"encoder": self.name, "frames": self.frames, "visual_tokens": self.visual_tokens,
                "frame_tokens": self.frame_tokens}


def vlm_encoder_factory(model: torch.nn.Module, tokenizer=None, *, frame_tokens: int = 256,
                        window: Window | None = Window(), prompt: Sequence[int] | str | None = None,
                        system_prompt: str | None = None, max_pixels: int = 4096 * 4096):
    """A zero-argument factory of `QwenVLEncoder`s that share one loaded model (for
    `streamer.media.MediaConfig.video_encoder`): each media stream gets its own stream cache,
    bounded by `window`, starting with `prompt` (text or token ids; its first tokens become the
    attention sinks). With a tokenizer and no `prompt`, the stream starts with the chat
    template's system prompt and open user turn (`VLMStream.data_prompt`), which `ask` closes.
    Streams of different sessions may run on different threads: a forward keeps its per-call
    state in its own metadata, never in the model."""

    def make() -> QwenVLEncoder:
        stream = VLMStream(model, tokenizer, frame_tokens=frame_tokens, window=window,
                           system_prompt=system_prompt)
        if prompt is None and tokenizer is not None:
            stream.append_text(stream.data_prompt())
        elif isinstance(prompt, str):
            stream.append_text(prompt)
        elif prompt:
            stream.append_tokens(prompt)
        return QwenVLEncoder(stream, max_pixels=max_pixels)

    return make


def vlm_factory_from_spec(spec: str, *, frame_tokens: int = 256, window: Window | None = Window(),
                          dtype: str = "float32", device: str = "cpu"):
    """An encoder factory from a model spec (for a CLI flag or server config): `tiny` is a seeded
    random-weight model without a tokenizer (demos, benches: it sees nothing real), anything
    else a Qwen2.5-VL checkpoint id or directory (loaded once, shared by all streams)."""
    if spec == "tiny":
        model, tokenizer = build_tiny_vlm(), None
    else:
        model, tokenizer = load_vlm(spec, dtype, device)
    return vlm_encoder_factory(model, tokenizer, frame_tokens=frame_tokens, window=window)


# ---------------------------------------------------------------------------------------------
# models


@dataclass(slots=True)
class TinyVLMConfig:
    """A tiny random-weight Qwen2.5-VL for tests and benchmarks (vocabulary of ids only)."""

    seed: int = 0
    vocab: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    max_positions: int = 4096
    vision_hidden: int = 32
    vision_depth: int = 2
    eos_token_id: int | None = None  # default: the top id
    extra: dict = field(default_factory=dict)


def build_tiny_vlm(config: TinyVLMConfig | None = None, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A seeded tiny Qwen2.5-VL (fp32 by default). Special ids sit at the top of the vocabulary."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = config or TinyVLMConfig()

    half = config.hidden // config.heads // 2  # rotary frequencies per head
    t = half // 4  # mrope_section splits them as Qwen2.5-VL does ([16, 24, 24] of 64): 1/4, 3/8, 3/8
    section = [t, (half - t) // 2, half - t - (half - t) // 2]
    v = config.vocab
    text = {"vocab_size": v, "hidden_size": config.hidden, "intermediate_size": config.hidden * 2,
            "num_hidden_layers": config.layers, "num_attention_heads": config.heads,
            "num_key_value_heads": config.kv_heads, "max_position_embeddings": config.max_positions,
            "bos_token_id": None, "pad_token_id": None,
            "eos_token_id": v - 1 if config.eos_token_id is None else config.eos_token_id,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}}
    vision = {"depth": config.vision_depth, "hidden_size": config.vision_hidden,
              "intermediate_size": config.vision_hidden * 2, "num_heads": 2, "out_hidden_size": config.hidden,
              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
              "fullatt_block_indexes": [config.vision_depth - 1]}
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=v - 6, video_token_id=v - 5,
                           vision_start_token_id=v - 4, vision_end_token_id=v - 3, **config.extra)
    torch.manual_seed(config.seed)
    return Qwen2_5_VLForConditionalGeneration(cfg).to(dtype).eval()


VL_SPECIAL_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>",
                     "<|vl_unused_0|>", "<|vl_unused_1|>")  # at the top of the vocabulary, as build_tiny_vlm wants


def build_tiny_vl(tokenizer, seed: int = 0, dtype: torch.dtype = torch.float32, layers: int = 2):
    """A tiny seeded random Qwen2.5-VL that runs on the engine with a real text tokenizer (the
    embedded one): the vision special tokens are added to the tokenizer, and the vocabulary is
    the tokenizer's. Loads in a second; the same seed gives the same weights in every process."""
    from streamer.sessions.models import LoadedModel

    tokenizer.add_special_tokens({"additional_special_tokens": list(VL_SPECIAL_TOKENS)})
    ids = tokenizer.convert_tokens_to_ids(list(VL_SPECIAL_TOKENS))
    if ids != list(range(len(tokenizer) - len(ids), len(tokenizer))):
        raise ValueError(f"the tokenizer already has some of {VL_SPECIAL_TOKENS}; use a fresh one")
    config = TinyVLMConfig(seed=seed, vocab=len(tokenizer), layers=layers, max_positions=8192,
                           eos_token_id=tokenizer.eos_token_id)
    model = build_tiny_vlm(config, dtype)
    return LoadedModel(model, tokenizer, f"tiny-vl-{layers}x{config.hidden}-seed{seed}")


def load_vlm(spec: str, dtype: str | torch.dtype = "float32",
             device: str = "cpu") -> tuple[torch.nn.Module, object]:
    """A Qwen2.5-VL checkpoint (Hugging Face id or local directory) and its tokenizer."""
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from streamer.sessions.models import ModelLoadError, parse_dtype

    try:
        tokenizer = AutoTokenizer.from_pretrained(spec)
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(spec, dtype=parse_dtype(dtype))
    except OSError as exc:
        raise ModelLoadError(f"cannot load vision-language model {spec!r}: {exc}") from exc
    return model.to(device).eval(), tokenizer
