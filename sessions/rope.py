"""Moving cached keys to new positions by rotation (RoPE is a rotation per frequency pair, so a
key computed at position p and turned by `delta * inv_freq` equals the key computed at p + delta).
Used to re-anchor a cache after eviction without running the model again."""

from __future__ import annotations

import torch

ROTATE_CHUNK = 512  # tokens rotated per pass: bounds the float32 temporaries


def rotate_keys(cache, start: int, length: int, delta: int, inv_freq: torch.Tensor) -> None:
    """Move the keys at own slots `[start, start + length)` of every layer of `cache` by `delta`
    positions (`inv_freq`: the model's rotary inverse frequencies; rotate-half layout, as Llama and
    Qwen use). Values carry no position and are left alone. All layers turn in one pass per chunk
    of tokens, computed in float32 from float64 angles."""
    if length <= 0 or delta == 0:
        return
    keys = cache.keys()  # [layers, kv_heads, slots, head_dim]
    angle = delta * inv_freq.to(torch.float64)
    cos = torch.cat([angle.cos(), angle.cos()]).to(torch.float32).to(keys.device)
    sin = torch.cat([angle.sin(), angle.sin()]).to(torch.float32).to(keys.device)
    half = cos.shape[0] // 2
    for lo in range(start, start + length, ROTATE_CHUNK):
        part = keys[:, :, lo:min(start + length, lo + ROTATE_CHUNK)]
        k = part.float()
        rotated = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
        part.copy_((k * cos + rotated * sin).to(part.dtype))


def inverse_frequencies(model) -> torch.Tensor:
    """The rotary inverse frequencies of a Hugging Face decoder (Llama, Qwen2, ...)."""
    for module in model.modules():
        inv = getattr(module, "inv_freq", None)
        if isinstance(inv, torch.Tensor):
            return inv.detach().float().cpu()
    raise ValueError(f"{type(model).__name__} has no rotary embedding (inv_freq) to re-anchor keys with")
