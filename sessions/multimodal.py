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

A frame becomes a `FrameInput` off the engine thread (patching and the vision tower, on the
media stream's thread: `frame_input`), then enters the session's cache as a `FrameJob`
(sessions/jobs.py): a prefill of embeddings, chunked and batched with other sessions' work.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch


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
    embeds: torch.Tensor
    rel: torch.Tensor
    extent: int
    grid: tuple[int, int]  # merged (gh, gw)
    image: np.ndarray  # the frame as the vision tower saw it (resized RGB uint8): what a log keeps
    digest: str  # content address of `image` (frame_digest)
    media_s: float | None = None  # the frame's media time (pts), when it came from a stream

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


@torch.inference_mode()
def frame_input(parts: VLParts, image: np.ndarray, max_tokens: int, label_ids: list[int] | None = None,
                media_s: float | None = None) -> FrameInput:
    """Patch an RGB uint8 frame `[H, W, 3]` to fit `max_tokens` merged tokens, run the vision
    tower and build the frame's input. Thread-safe: it reads the model's weights only."""
    from streamer.vision.vlm_patches import PatchSpec, fit_frame, patchify

    model = parts.model
    spec = PatchSpec.from_config(model.config.vision_config)
    image = fit_frame(image, max_tokens, spec)
    pixels, grid = patchify(image, max_tokens, spec)
    param = parts.weight
    grid_thw = torch.tensor([grid], device=param.device)
    out = model.model.get_image_features(pixels.to(param.device, param.dtype), grid_thw)
    vision = torch.cat(out.pooler_output).to(param.dtype)
    m = spec.merge_size
    gh, gw = grid[1] // m, grid[2] // m
    label_ids = list(label_ids or ())
    ids = label_ids + [parts.vision_start_id] + [parts.image_token_id] * vision.shape[0] + [parts.vision_end_id]
    text = parts.embed(label_ids + [parts.vision_start_id, parts.vision_end_id])
    embeds = torch.cat([text[:-1], vision, text[-1:]])
    rel, extent = frame_positions(len(label_ids), gh, gw)
    return FrameInput(ids, embeds, rel, extent, (gh, gw), image, frame_digest(image), media_s)


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
