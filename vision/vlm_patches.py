"""Pixels to Qwen2.5-VL patches, in numpy/torch.

transformers' fast Qwen2-VL image processor needs torchvision, which does not import beside
this torch build, and its PIL processor needs Pillow; this module needs neither. It resizes a
frame to fit a visual-token budget (the processor's `smart_resize` rule), normalises it, and
lays the patches out exactly as the vision tower reads them (tests/vision/test_vlm.py checks
the layout and compares with the transformers processor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .errors import UnsupportedMedia

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # the image processor's normalisation (OpenAI CLIP)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT = 200  # Qwen2-VL's processor refuses more extreme aspect ratios


@dataclass(frozen=True, slots=True)
class PatchSpec:
    """How the vision tower wants its pixels (read from the model's vision config)."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56

    @classmethod
    def from_config(cls, vision_config) -> PatchSpec:
        return cls(patch_size=vision_config.patch_size, merge_size=vision_config.spatial_merge_size,
                   temporal_patch_size=vision_config.temporal_patch_size)

    @property
    def factor(self) -> int:
        """Pixels per merged token along one side (28 for Qwen2.5-VL)."""
        return self.patch_size * self.merge_size


def fit_size(height: int, width: int, max_tokens: int, spec: PatchSpec = PatchSpec()) -> tuple[int, int]:
    """The resized (height, width) for a frame: multiples of `spec.factor`, aspect ratio kept as
    far as rounding allows, at most `max_tokens` merged tokens. Follows Qwen2-VL's
    `smart_resize` (same result whenever that fits the budget), then shrinks the longer side
    if rounding up to one factor overshot a small budget."""
    if height < 1 or width < 1:
        raise UnsupportedMedia(f"frame of {width}x{height} pixels has no area")
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise UnsupportedMedia(f"frame of {width}x{height}: aspect ratio beyond {MAX_ASPECT}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    f = spec.factor
    max_pixels = max_tokens * f * f
    min_pixels = min(spec.min_pixels, max_pixels)
    h, w = round(height / f) * f, round(width / f) * f
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(f, math.floor(height / beta / f) * f)
        w = max(f, math.floor(width / beta / f) * f)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    while (h // f) * (w // f) > max_tokens:  # only for extreme aspect ratios on tiny budgets
        if h >= w:
            h -= f
        else:
            w -= f
    return h, w


def _readable(image: np.ndarray) -> np.ndarray:
    """A contiguous array torch may wrap (decoded frames and blobs can be read-only views)."""
    image = np.ascontiguousarray(image)
    return image if image.flags.writeable else image.copy()


def fit_frame(image: np.ndarray, max_tokens: int, spec: PatchSpec = PatchSpec()) -> np.ndarray:
    """The RGB uint8 frame resized as `patchify` resizes it (bicubic, antialiased, rounded to 8
    bits): what the vision tower sees, and what a log keeps to rebuild it (fitting it again
    changes nothing)."""
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise UnsupportedMedia(f"frames must be RGB uint8 [H, W, 3], got {image.dtype} {list(image.shape)}")
    height, width = image.shape[:2]
    h, w = fit_size(height, width, max_tokens, spec)
    if (h, w) == (height, width):
        return image
    pixels = torch.from_numpy(_readable(image)).permute(2, 0, 1).float()
    pixels = F.interpolate(pixels[None], size=(h, w), mode="bicubic", antialias=True,
                           align_corners=False)[0].round_().clamp_(0, 255)
    return pixels.to(torch.uint8).permute(1, 2, 0).contiguous().numpy()


def patchify(image: np.ndarray, max_tokens: int,
             spec: PatchSpec = PatchSpec()) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """An RGB uint8 frame `[H, W, 3]` -> (pixel_values `[gh * gw, 3 * T * P * P]` float32, grid
    `(1, gh, gw)` in patches). Resized (bicubic, antialiased, rounded to 8 bits like the PIL
    processor) to fit `max_tokens`, scaled to [0, 1], CLIP-normalised, and laid out as the
    vision tower reads it: rows in merge order (merge blocks row-major, patches row-major
    inside a block), each row channel-major then time (the still frame repeated
    `temporal_patch_size` times) then patch rows and columns."""
    image = fit_frame(image, max_tokens, spec)
    h, w = image.shape[:2]
    pixels = torch.from_numpy(_readable(image)).permute(2, 0, 1).float()  # [3, H, W]
    mean = torch.tensor(CLIP_MEAN).view(3, 1, 1)
    std = torch.tensor(CLIP_STD).view(3, 1, 1)
    pixels = (pixels / 255.0 - mean) / std
    p, m, t = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    gh, gw = h // p, w // p
    blocks = pixels.reshape(3, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    blocks = blocks.unsqueeze(5).expand(*blocks.shape[:5], t, p, p)  # (bh, bw, mh, mw, C, T, ph, pw)
    return blocks.reshape(gh * gw, 3 * t * p * p).contiguous(), (1, gh, gw)
