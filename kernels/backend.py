"""Attention backend selection, and the step planner of the Triton backend.

Backends: `reference` (pure torch, runs everywhere, the oracle) and `triton` (fused kernels in
`triton_attention`, CUDA; on the CPU only under Triton's interpreter, `TRITON_INTERPRET=1`).
`auto` picks triton when the model is on a CUDA device and triton imports, else reference.
The setting comes from the caller (engine config, CLI flag) or, when it gives none, from the
environment variable `STREAMER_ATTENTION_BACKEND`.

`plan_step` turns a model step's sequences into an `AttentionPlan`. It reads caches through
the interface the session caches share (`layer(i)`, `prefix`, `prefix_len`): a pool cache is
its shared-prefix extent plus its own extent, each passed by address; nothing is copied.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

BACKENDS = ("auto", "reference", "triton")
ENV_VAR = "STREAMER_ATTENTION_BACKEND"


class BackendUnavailable(ValueError):
    """The requested attention backend cannot run here."""

    code = "attention_backend_unavailable"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def triton_import_error() -> str | None:
    """None when the Triton kernels import, else why not."""
    try:
        from . import triton_attention  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install failing at import
        return f"{type(exc).__name__}: {exc}"
    return None


def _kernels_interpreted() -> bool:
    from . import triton_attention

    return type(triton_attention._attention_kernel).__name__ == "InterpretedFunction"


def resolve_backend(requested: str | None, device: torch.device | str) -> str:
    """The backend to run: "reference" or "triton". Raises ValueError for an unknown name and
    BackendUnavailable when triton is asked for where it cannot run."""
    name = (requested or os.environ.get(ENV_VAR) or "auto").strip().lower()
    if name not in BACKENDS:
        source = "" if requested else f" (from {ENV_VAR})"
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {name!r}{source}")
    if name == "reference":
        return name
    device = torch.device(device)
    if name == "auto":
        if device.type != "cuda" or interpreting():
            return "reference"
        return "triton" if triton_import_error() is None else "reference"
    error = triton_import_error()
    if error is not None:
        raise BackendUnavailable(f"attention backend 'triton' needs the triton package "
                                 f"(pip install 'streamer[triton]'): {error}")
    if device.type == "cuda":
        if _kernels_interpreted():
            raise BackendUnavailable("attention backend 'triton' on CUDA, but the kernels were built for "
                                     "Triton's CPU interpreter (unset TRITON_INTERPRET)")
        return name
    if device.type == "cpu" and interpreting() and _kernels_interpreted():
        return name
    if device.type == "cpu" and interpreting():
        raise BackendUnavailable("TRITON_INTERPRET=1 was set after the Triton kernels were imported; "
                                 "set it before starting")
    raise BackendUnavailable(f"attention backend 'triton' runs on CUDA devices, and the model is on {device}; "
                             f"use 'reference' or 'auto' (or set TRITON_INTERPRET=1 to run the kernels in "
                             f"Triton's CPU interpreter, slowly)")


# ---- the step planner ------------------------------------------------------------------------


def _layer_stride(cache) -> int:
    """Elements between layer 0's and layer 1's key buffer of a cache (0 for one layer)."""
    k0 = cache.layer(0)[0]
    try:
        k1 = cache.layer(1)[0]
    except IndexError:
        return 0
    return (k1.data_ptr() - k0.data_ptr()) // k0.element_size()


def _range(cache, length: int, causal_start: int | None = None):
    from .triton_attention import KVRange

    k, v = cache.layer(0)
    return KVRange(k, v, length, causal_start, _layer_stride(cache))


def _shared_ranges(cache, length: int) -> list:
    """A read-only `(cache, length)` as ranges: a pool cache's shared prefix, then its own part."""
    shared = cache.prefix_len
    if not shared:
        return [_range(cache, length)] if length > 0 else []
    out = [_range(cache.prefix, min(length, shared))]
    if length > shared:
        out.append(_range(cache, length - shared))
    return out


def plan_step(seqs: Sequence, heads: int, kv_heads: int, head_dim: int, device: torch.device,
              fork_suffix_max: int = 128, **plan_options):
    """An `AttentionPlan` for one model step.

    `seqs`: objects with `cache`, `start`, `n`, `prefixes` (`(cache, length)` pairs it reads
    in full) and `offset` (its first token in the packed batch), as the runner's `SeqStep`.
    A sequence's own cache holds its new tokens at `[start, start + n)`, read offset-causally.
    A sequence with read-only ranges is one fused pass over all of them and its own cache;
    short forks over the same ranges (`own part <= fork_suffix_max`) are planned together, so
    the shared ranges are read once for all their queries.
    """
    from .triton_attention import AttentionPlan

    plan = AttentionPlan(heads, kv_heads, head_dim, device, **plan_options)
    groups: dict[tuple, list] = {}
    for seq in seqs:
        cache = seq.cache
        own_start = seq.start - cache.prefix_len
        tokens = range(seq.offset, seq.offset + seq.n)
        own = _range(cache, own_start + seq.n, causal_start=own_start)
        keys = [(c, n) for c, n in seq.prefixes if n > 0]
        if cache.prefix_len:
            keys.append((cache.prefix, cache.prefix_len))
        if not keys or own_start > fork_suffix_max:
            plan.sequence(tokens, [r for c, n in keys for r in _shared_ranges(c, n)] + [own])
        else:
            groups.setdefault(tuple((id(c), n) for c, n in keys), []).append((tokens, own, keys))
    for group in groups.values():
        shared = [r for c, n in group[0][2] for r in _shared_ranges(c, n)]
        if len(group) == 1:
            plan.sequence(group[0][0], shared + [group[0][1]])
        else:
            plan.forks([t for t, _, _ in group], shared, [[own] for _, own, _ in group])
    plan.build()
    return plan
