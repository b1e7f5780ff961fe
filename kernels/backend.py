"""Attention backend selection, and the step planner of the Triton backend.

Backends: `reference` (pure torch, runs everywhere, the oracle) and `triton` (fused kernels in
`triton_attention`, CUDA; on the CPU only under Triton's interpreter, `TRITON_INTERPRET=1`).
`auto` picks triton when the model is on a CUDA device and triton imports, else reference.
The setting comes from the caller (engine config, CLI flag) or, when it gives none, from the
environment variable `STREAMER_ATTENTION_BACKEND`.

`plan_step` turns a model step's sequences into the step's attention plan, once per step, for
either backend: a `ReferencePlan` (which sequences read only their own cache, which also read
read-only ranges, which forks share ranges and are batched over them) or the Triton
`AttentionPlan`. Every layer then runs the same plan. It reads caches through the interface the
session caches share (`layer(i)`, `prefix`, `prefix_len`): a pool cache is its shared-prefix
extent plus its own extent, each read in place; nothing is copied.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence

import torch

from .reference import cache_attention, forked_attention, own_causal_bias, ranges_attention

BACKENDS = ("auto", "reference", "triton")
ENV_VAR = "STREAMER_ATTENTION_BACKEND"


class BackendUnavailable(ValueError):
    """The requested attention backend cannot run here."""

    code = "attention_backend_unavailable"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def triton_kernels():
    """The Triton kernels' module (`triton_attention`), imported at first use: triton is an
    optional dependency, and the kernels are defined for the CUDA compiler or for the CPU
    interpreter by `TRITON_INTERPRET` as it is when they are imported."""
    return importlib.import_module(".triton_attention", __package__)


def triton_import_error() -> str | None:
    """None when the Triton kernels import, else why not."""
    try:
        triton_kernels()
    except Exception as exc:  # ImportError, or a broken install failing at import
        return f"{type(exc).__name__}: {exc}"
    return None


def _kernels_interpreted() -> bool:
    return type(triton_kernels()._attention_kernel).__name__ == "InterpretedFunction"


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


def read_only_parts(cache, length: int) -> list[tuple[object, int]]:
    """A read-only `(cache, length)` as the buffers it lies in: a pool cache's shared prefix,
    then its own part (each `(buffer, tokens)`, where a buffer has `layer(i)`)."""
    shared = cache.prefix_len
    if length <= 0:
        return []
    if not shared:
        return [(cache, length)]
    out = [(cache.prefix, min(length, shared))]
    if length > shared:
        out.append((cache, length - shared))
    return out


def sequence_layout(seq) -> tuple[int, list[tuple[object, int]]]:
    """Where a step's sequence writes and what it reads, as every backend's plan lays it out:
    its new tokens' first slot in its own buffer (`start` less its cache's shared prefix), and
    the read-only parts it reads before its own keys, in order: its prefixes' buffers, then its
    own cache's shared prefix (each `(buffer, tokens)`, tokens > 0)."""
    cache = seq.cache
    parts = [p for c, n in seq.prefixes for p in read_only_parts(c, n)]
    if cache.prefix_len:
        parts.append((cache.prefix, cache.prefix_len))
    return seq.start - cache.prefix_len, parts


def parts_key(parts: Sequence[tuple[object, int]]) -> tuple:
    """What makes two sequences' read-only parts the same reads (they may be planned together)."""
    return tuple((id(c), n) for c, n in parts)


def _layout(seqs: Sequence, fork_suffix_max: int):
    """Sort a step's sequences into plain ones (own cache only), ranged ones (a session's
    reading over its shared prefix, or a fork with a long own cache, plus read-only ranges) and
    groups of short forks that share the same read-only ranges.
    Each item: (sequence, own_start, read-only parts)."""
    plain, ranged, groups = [], [], {}
    for seq in seqs:
        own_start, parts = sequence_layout(seq)
        if not parts:
            plain.append((seq, own_start, parts))
        elif own_start > fork_suffix_max or not seq.prefixes:  # a session's reading is never grouped
            ranged.append((seq, own_start, parts))
        else:
            groups.setdefault(parts_key(parts), []).append((seq, own_start, parts))
    return plain, ranged, list(groups.values())


class ReferencePlan:
    """The reference backend's plan of a step: built once, run by every layer.

    A sequence that reads only its own cache takes the plain offset-causal path; one that also
    reads read-only ranges (its session's shared system-prompt blocks, a fork's session) is
    merged by log-sum-exp; short forks over the same ranges are batched so each range is read
    once for all of them.
    """

    def __init__(self, seqs: Sequence, fork_suffix_max: int = 128) -> None:
        self.plain, self.ranged, self.forks = _layout(seqs, fork_suffix_max)
        self._biases: list | None = None  # per plain, then ranged sequence: its own_causal_bias

    def _own_biases(self, query: torch.Tensor, layer: int) -> list:
        if self._biases is None:  # once per step, on the first layer: every layer has the same shapes
            own = self.plain + self.ranged
            kv_heads = own[0][0].cache.layer(layer)[0].shape[0] if own else 1
            built: dict = {}  # sessions in step with one another often have the same shape: one mask each
            self._biases = []
            for seq, start, parts in own:
                key = (seq.n, start, sum(n for _, n in parts))
                if key not in built:
                    built[key] = own_causal_bias(query.shape[0], kv_heads, seq.n, start, query.dtype, query.device,
                                                 before=key[2])
                self._biases.append(built[key])
        return self._biases

    def run(self, query: torch.Tensor, layer: int, out: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        """`query` `[heads, tokens, d]` (packed), `out` `[tokens, heads, d]`."""
        biases = iter(self._own_biases(query, layer))
        for (seq, start, _), bias in zip(self.plain, biases):
            src = slice(seq.offset, seq.offset + seq.n)
            if bias is None:
                out[src] = cache_attention(query[:, src], *seq.cache.layer(layer), start, scaling)
            else:  # one masked call over its own cache (no read-only ranges)
                out[src] = ranges_attention(query[:, src], [], *seq.cache.layer(layer), start, scaling, bias)
        for (seq, start, parts), bias in zip(self.ranged, biases):
            src = slice(seq.offset, seq.offset + seq.n)
            out[src] = ranges_attention(query[:, src], [(*c.layer(layer), n) for c, n in parts],
                                        *seq.cache.layer(layer), start, scaling, bias)
        for group in self.forks:
            results = forked_attention(
                [query[:, s.offset:s.offset + s.n] for s, _, _ in group],
                [(*c.layer(layer), n) for c, n in group[0][2]],
                [(*s.cache.layer(layer), start) for s, start, _ in group], scaling)
            for (s, _, _), r in zip(group, results):
                out[s.offset:s.offset + s.n] = r
        return out


def layer_stride(cache, k0: torch.Tensor | None = None) -> int:
    """Elements between layer 0's and layer 1's key buffer of a cache (0 for one layer); `k0`:
    layer 0's keys where the caller has them (one view fewer to make)."""
    k0 = cache.layer(0)[0] if k0 is None else k0
    try:
        k1 = cache.layer(1)[0]
    except IndexError:
        return 0
    return (k1.data_ptr() - k0.data_ptr()) // k0.element_size()


def _range(cache, length: int, causal_start: int | None = None):
    k, v = cache.layer(0)
    return triton_kernels().KVRange(k, v, length, causal_start, layer_stride(cache, k))


def triton_plan(seqs: Sequence, heads: int, kv_heads: int, head_dim: int, device: torch.device,
                fork_suffix_max: int = 128, **plan_options):
    """The Triton backend's `AttentionPlan` for one model step.

    `seqs`: objects with `cache`, `start`, `n`, `prefixes` (`(cache, length)` pairs it reads
    in full) and `offset` (its first token in the packed batch), as the runner's `SeqStep`.
    A sequence's own cache holds its new tokens at `[start, start + n)`, read offset-causally.
    A sequence with read-only ranges is one fused pass over all of them and its own cache;
    short forks over the same ranges (`own part <= fork_suffix_max`) are planned together, so
    the shared ranges are read once for all their queries.
    """
    plan = triton_kernels().AttentionPlan(heads, kv_heads, head_dim, device, **plan_options)
    plain, ranged, groups = _layout(seqs, fork_suffix_max)

    def tokens(seq):
        return range(seq.offset, seq.offset + seq.n)

    def own(seq, start):
        return _range(seq.cache, start + seq.n, causal_start=start)

    for seq, start, parts in plain + ranged:
        plan.sequence(tokens(seq), [_range(c, n) for c, n in parts] + [own(seq, start)])
    for group in groups:
        shared = [_range(c, n) for c, n in group[0][2]]
        if len(group) == 1:
            seq, start, _ = group[0]
            plan.sequence(tokens(seq), shared + [own(seq, start)])
        else:
            plan.forks([tokens(s) for s, _, _ in group], shared, [[own(s, start)] for s, start, _ in group])
    plan.build()
    return plan


def plan_step(seqs: Sequence, backend: str, heads: int, kv_heads: int, head_dim: int, device: torch.device,
              fork_suffix_max: int = 128):
    """The attention plan of one model step for `backend` ("reference" or "triton")."""
    if backend == "triton":
        return triton_plan(seqs, heads, kv_heads, head_dim, device, fork_suffix_max)
    return ReferencePlan(seqs, fork_suffix_max)
