"""Attention for ragged session caches.

`reference` is pure torch and runs everywhere; it is the oracle for any faster backend.
`triton_attention` holds the fused Triton kernels (CUDA; the CPU under TRITON_INTERPRET=1) and
`backend` chooses between them and plans a step for the Triton one; both import triton only
when used. This package imports nothing else from the project.
"""

from .reference import cache_attention, causal_offset_mask, forked_attention, merge_partials, ranges_attention

__all__ = ["cache_attention", "causal_offset_mask", "forked_attention", "merge_partials", "ranges_attention"]
