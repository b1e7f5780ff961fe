"""Vision-language models on the engine: the model's parts the runner needs, and frames as input.

An engine's model may be a Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`). The runner then
feeds its language model input *embeddings* (token embeddings for text, vision-tower embeddings
for frames) with explicit 3-D M-RoPE positions `[3, n]` (t, h, w), and the sessions' caches, jobs,
windows and batches are the same as for a text model.

Positions (Qwen2.5-VL M-RoPE, as the model's own `get_rope_index` numbers one multimodal
sequence): a text token at position p has (t, h, w) = (p, p, p); a frame whose merged grid is
gh x gw and whose vision tokens start at p has t = p, h = p + row, w = p + col, and the token
after it starts at p + max(gh, gw). So a session's next position differs from its cache length
once it holds a frame: `Session.position_offset` is the difference (0 for text-only sessions
and for text models). A uniform shift of all three components is an ordinary RoPE rotation
(each rotary frequency is fed by one component, and all turn by shift x inv_freq), so eviction
re-anchors a VL cache with the same `rope.rotate_keys` as a text one.

A frame becomes a `FrameInput` in two parts. Off the engine thread (the media stream's):
resizing and patching (`frame_patches`: numpy/torch on the pixels, no model weights). On the
engine thread, as the first part of its `FrameJob` (sessions/jobs.py): the vision tower
(`encode_frames`), run once per step for every frame job of the step (`vision_step`: one call
over all sessions' frames, so one thread does model compute); then the frame is a prefill of
embeddings, chunked and batched with other sessions' work. The tower's output for a frame does
not depend on the frames beside it (its attention is per image: `cu_seqlens`). `frame_input`
does both parts at once (replay, tests, benchmarks).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import numpy as np
import torch

from streamer.vision.vlm_patches import PatchSpec, fit_frame, patchify

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class VLParts:
    """What the runner uses of a Qwen2.5-VL: its language model, head, embeddings, special ids."""

    model: torch.nn.Module
    image_token_id: int
    vision_start_id: int
    vision_end_id: int

    @property
    def lm(self) -> torch.nn.Module:
        return self.model.model.language_model

    @property
    def head(self) -> torch.nn.Module:
        return self.model.lm_head

    @property
    def weight(self) -> torch.Tensor:
        """The token embedding table: its device and dtype are the inputs' (linear layers may
        be packed into another weight format, the embeddings never are)."""
        return self.lm.embed_tokens.weight

    def embed(self, ids) -> torch.Tensor:
        """Token embeddings `[n, hidden]` of `ids`."""
        return self.lm.embed_tokens(torch.as_tensor(list(ids), dtype=torch.long, device=self.weight.device))


def vl_parts(model: torch.nn.Module) -> VLParts | None:
    """The VL parts of `model`, or None for a text-only causal LM."""
    cfg = model.config
    if getattr(cfg, "vision_config", None) is None or getattr(cfg, "image_token_id", None) is None:
        return None
    return VLParts(model, int(cfg.image_token_id), int(cfg.vision_start_token_id), int(cfg.vision_end_token_id))


def text_positions(start: int, n: int) -> torch.Tensor:
    """M-RoPE positions `[3, n]` of n text tokens from `start`."""
    return torch.arange(start, start + n).expand(3, -1)


@dataclass(slots=True)
class FrameInput:
    """One frame ready for a session's cache: `ids` are the placeholder token ids it stands for
    (an optional text label, `<|vision_start|>`, one image token per merged patch,
    `<|vision_end|>`: the ids the model's own processor would put in input_ids), `embeds` their
    input embeddings `[len(ids), hidden]`, `rel` their M-RoPE positions `[3, len(ids)]` counted
    from the position where the frame starts, `extent` how far it advances the next position."""

    ids: list[int]
    embeds: torch.Tensor | None  # None until the vision tower ran (`encode_frames`, on the engine thread)
    rel: torch.Tensor
    extent: int
    grid: tuple[int, int]  # merged (gh, gw)
    image: np.ndarray  # the frame as the vision tower saw it (resized RGB uint8): what a log keeps
    digest: str  # content address of `image` (frame_digest)
    media_s: float | None = None  # the frame's media time (pts), when it came from a stream
    pixels: torch.Tensor | None = None  # the tower's input patches until it ran (`patchify`)
    thw: tuple[int, int, int] | None = None  # their (t, h, w) patch grid
    label: int = 0  # text tokens before `<|vision_start|>`

    @property
    def visual_tokens(self) -> int:
        return self.grid[0] * self.grid[1]


def frame_positions(label: int, gh: int, gw: int) -> tuple[torch.Tensor, int]:
    """Relative positions `[3, label + gh * gw + 2]` of a frame after `label` text tokens, and
    its extent: label tokens 0..label-1, the start marker at `label`, the vision tokens from
    `label + 1` on a (t, row, col) grid, the end marker after them."""
    p = label + 1
    rows = torch.arange(gh).repeat_interleave(gw)
    cols = torch.arange(gw).repeat(gh)
    vision = torch.stack([torch.zeros(gh * gw, dtype=torch.long), rows, cols]) + p
    end = p + max(gh, gw)
    rel = torch.cat([text_positions(0, p), vision, torch.full((3, 1), end)], 1)
    return rel, end + 1


def frame_patches(parts: VLParts, image: np.ndarray, max_tokens: int, label_ids: list[int] | None = None,
                  media_s: float | None = None) -> FrameInput:
    """An RGB uint8 frame `[H, W, 3]` resized to fit `max_tokens` merged tokens and cut into the
    vision tower's patches: a `FrameInput` whose ids, positions and digest are final and whose
    embeddings the tower makes later (`encode_frames`). Reads the model's config only, so any
    thread may call it."""

    spec = PatchSpec.from_config(parts.model.config.vision_config)
    image = fit_frame(image, max_tokens, spec)
    pixels, grid = patchify(image, max_tokens, spec)
    m = spec.merge_size
    gh, gw = grid[1] // m, grid[2] // m
    label_ids = list(label_ids or ())
    ids = label_ids + [parts.vision_start_id] + [parts.image_token_id] * (gh * gw) + [parts.vision_end_id]
    rel, extent = frame_positions(len(label_ids), gh, gw)
    return FrameInput(ids, None, rel, extent, (gh, gw), image, frame_digest(image), media_s, pixels, tuple(grid),
                      len(label_ids))


@torch.inference_mode()
def encode_frames(parts: VLParts, frames: list[FrameInput]) -> None:
    """Run the vision tower once over `frames` (patched, not yet encoded) and give each its input
    embeddings: label and marker token embeddings around its vision embeddings. One call for
    all: the tower's attention is per image, so each frame's embeddings are those it gets alone."""
    if not frames:
        return
    param = parts.weight
    pixels = torch.cat([f.pixels for f in frames]).to(param.device, param.dtype)
    grid_thw = torch.tensor([f.thw for f in frames], device=param.device)
    vision = parts.model.model.get_image_features(pixels, grid_thw).pooler_output
    embeds = []
    for f, v in zip(frames, vision, strict=True):
        text = parts.embed(f.ids[:f.label] + [parts.vision_start_id, parts.vision_end_id])
        embeds.append(torch.cat([text[:-1], v.to(param.dtype), text[-1:]]))
    for f, e in zip(frames, embeds):  # all or none: a failed call leaves every frame as it was
        f.embeds, f.pixels = e, None


def vision_step(parts: VLParts | None, jobs) -> None:
    """The vision tower for every job of a step that still needs it (`needs_vision`: a frame
    job's first part), in one call on the engine thread. If that call fails, each job runs the
    tower for its own frame as it plans, and fails alone."""
    frames = [job.frame for job in jobs if getattr(job, "needs_vision", False)]
    if parts is None or not frames:
        return
    try:
        encode_frames(parts, frames)
    except Exception:  # noqa: BLE001 - each job retries alone as it plans and fails with its own error
        log.warning("the vision tower failed for %d frames batched; they are encoded one by one", len(frames))


def frame_input(parts: VLParts, image: np.ndarray, max_tokens: int, label_ids: list[int] | None = None,
                media_s: float | None = None) -> FrameInput:
    """Patch an RGB uint8 frame `[H, W, 3]` to fit `max_tokens` merged tokens, run the vision
    tower and build the frame's input (`frame_patches` and `encode_frames` at once, on the
    calling thread). Thread-safe: it reads the model's weights only."""
    frame = frame_patches(parts, image, max_tokens, label_ids, media_s)
    encode_frames(parts, [frame])
    return frame


def frame_digest(image: np.ndarray) -> str:
    """Content address of an RGB uint8 frame: sha256 over its shape and bytes."""
    h = hashlib.sha256(f"{image.shape[0]}x{image.shape[1]}:".encode())
    h.update(np.ascontiguousarray(image).tobytes())
    return h.hexdigest()


def frame_blob(image: np.ndarray) -> bytes:
    """A frame as a blob for the log: `HxW\\n` then its zlib-compressed RGB bytes."""
    import zlib

    return f"{image.shape[0]}x{image.shape[1]}\n".encode() + zlib.compress(np.ascontiguousarray(image).tobytes(), 6)


def blob_frame(blob: bytes) -> np.ndarray:
    """The frame of a `frame_blob` (ValueError if it is not one)."""
    import zlib

    head, _, body = blob.partition(b"\n")
    h, _, w = head.decode().partition("x")
    return np.frombuffer(zlib.decompress(body), dtype=np.uint8).reshape(int(h), int(w), 3)
