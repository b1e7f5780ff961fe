"""Attention for ragged session caches.

`reference` is pure torch and runs everywhere; it is the oracle for any faster backend.
This package imports nothing else from the project.
"""

from .reference import cache_attention, causal_offset_mask, forked_attention, merge_partials, ranges_attention

__all__ = ["cache_attention", "causal_offset_mask", "forked_attention", "merge_partials", "ranges_attention"]
