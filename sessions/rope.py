"""Moving cached keys to new positions by rotation (RoPE is a rotation per frequency pair, so a
key computed at position p and turned by `delta * inv_freq` equals the key computed at p + delta).
Used to re-anchor a cache after eviction without running the model again."""

from __future__ import annotations

import torch


def rotate_keys(cache, start: int, length: int, delta: int, inv_freq: torch.Tensor) -> None:
    """Move the keys at own slots `[start, start + length)` of every layer of `cache` by `delta`
    positions (`inv_freq`: the model's rotary inverse frequencies; rotate-half layout, as Llama and
    Qwen use). Values carry no position and are left alone. Computed in float32 (float64 angles)."""
    angle = delta * inv_freq.to(torch.float64)
    cos = torch.cat([angle.cos(), angle.cos()]).to(torch.float32)
    sin = torch.cat([angle.sin(), angle.sin()]).to(torch.float32)
    half = cos.shape[0] // 2
    for layer in range(cache.shape.layers):
        keys = cache.layer(layer)[0][:, start:start + length]
        k = keys.float()
        rotated = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
        keys.copy_((k * cos.to(k.device) + rotated * sin.to(k.device)).to(keys.dtype))
