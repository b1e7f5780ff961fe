"""The model runner: one forward over new tokens of one or more sessions, on their live caches.

Hugging Face model definitions run unchanged. We register an attention function with
transformers' `AttentionInterface`; the model is called with `use_cache=False`, explicit
`position_ids` and a `StepMetadata` object passed as a keyword argument, which transformers
hands to every attention call. The attention function writes each layer's new keys/values
into the sessions' caches at explicit slots and attends over them with the runner's attention
backend: the pure-torch reference, or the fused Triton kernels (`kernels.backend`), which run
from a plan built once per step from the caches' extents. No globals carry per-step state, and
nothing is monkeypatched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from streamer.kernels import cache_attention, forked_attention, ranges_attention
from streamer.kernels.backend import plan_step, resolve_backend

from .kvcache import KVCache, KVShape

ATTENTION_NAME = "streamer_cache"


@dataclass(slots=True)
class SeqStep:
    """New tokens of one sequence in a packed step: written at cache slots [start, start+n).

    A fork (a question, a flash question, a reasoning stream) may keep its tokens in a cache of
    its own on top of read-only ranges of other caches: `prefixes` lists `(cache, length)`, and
    its tokens attend to all of those plus its own cache, causally. Forks with the same
    prefixes in one step read them once. Positions start at `pos0` (default: after the
    prefixes, i.e. their summed length + start).
    """

    cache: KVCache
    start: int
    tokens: Sequence[int]
    prefixes: tuple[tuple[KVCache, int], ...] = ()
    pos0: int | None = None
    offset: int = 0  # index of the first token in the packed batch

    @property
    def n(self) -> int:
        return len(self.tokens)

    @property
    def position(self) -> int:
        if self.pos0 is not None:
            return self.pos0 + self.start
        return sum(length for _, length in self.prefixes) + self.start


@dataclass(slots=True)
class StepMetadata:
    seqs: list[SeqStep] = field(default_factory=list)
    backend: str = "reference"
    plan: object = None  # the Triton backend's plan, built at the first layer, reused by the others


FORK_SUFFIX_MAX = 128  # own tokens up to which forks of one group are batched together


def _ranges(cache, length: int) -> list[tuple[object, int]]:
    """A read-only `(cache, length)` as attention ranges: a paged cache's shared prefix, then
    its own part."""
    shared = cache.prefix_len
    if not shared:
        return [(cache, length)]
    out = [(cache.prefix, min(length, shared))]
    if length > shared:
        out.append((cache, length - shared))
    return out


def _session_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       streamer_meta: StepMetadata | None = None, **kwargs):
    """transformers attention hook: query `[1, H, N, D]`, key/value `[1, Hkv, N, D]` (packed).

    Each sequence's new K/V go to its own cache at explicit slots. A sequence that reads only
    its own cache takes the plain path; one that also reads shared ranges (a session's shared
    system-prompt blocks, a fork's session) is merged by log-sum-exp; short forks over the same
    ranges are batched so each range is read once for all of them.
    """
    if streamer_meta is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention needs `streamer_meta`; run through ModelRunner")
    layer = module.layer_idx
    out = query.new_empty((query.shape[2], query.shape[1], query.shape[3]))  # [N, H, D]
    if streamer_meta.backend == "triton":
        return _triton_attention(layer, query, key, value, out, scaling, streamer_meta)
    forks: dict[tuple, list[tuple[SeqStep, int, list]]] = {}
    for seq in streamer_meta.seqs:
        cache = seq.cache
        shared = cache.prefix_len
        own_start = seq.start - shared
        k_cache, v_cache = cache.layer(layer)
        src = slice(seq.offset, seq.offset + seq.n)
        k_cache[:, own_start:own_start + seq.n] = key[0, :, src]
        v_cache[:, own_start:own_start + seq.n] = value[0, :, src]
        ranges = [r for c, n in seq.prefixes for r in _ranges(c, n)]
        if shared:
            ranges.append((cache.prefix, shared))
        q = query[0, :, src]
        if not ranges:
            out[src] = cache_attention(q, k_cache, v_cache, own_start, scaling)
        elif own_start > FORK_SUFFIX_MAX:
            out[src] = ranges_attention(q, [(*c.layer(layer), n) for c, n in ranges], k_cache, v_cache,
                                        own_start, scaling)
        else:
            forks.setdefault(tuple((id(c), n) for c, n in ranges), []).append((seq, own_start, ranges))
    for group in forks.values():
        ranges = group[0][2]
        results = forked_attention(
            [query[0, :, s.offset:s.offset + s.n] for s, _, _ in group],
            [(*c.layer(layer), n) for c, n in ranges],
            [(*s.cache.layer(layer), own_start) for s, own_start, _ in group], scaling)
        for (s, _, _), r in zip(group, results):
            out[s.offset:s.offset + s.n] = r
    return out.unsqueeze(0), None


def _triton_attention(layer, query, key, value, out, scaling, meta: StepMetadata):
    """Write every sequence's new K/V, then run the step's plan for this layer."""
    for seq in meta.seqs:
        own_start = seq.start - seq.cache.prefix_len
        k_cache, v_cache = seq.cache.layer(layer)
        k_cache[:, own_start:own_start + seq.n] = key[0, :, seq.offset:seq.offset + seq.n]
        v_cache[:, own_start:own_start + seq.n] = value[0, :, seq.offset:seq.offset + seq.n]
    if meta.plan is None:
        meta.plan = plan_step(meta.seqs, query.shape[1], key.shape[1], query.shape[3], query.device,
                              fork_suffix_max=FORK_SUFFIX_MAX)
    meta.plan.run(query[0].transpose(0, 1), layer, out=out, scaling=scaling)
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs):
    """Masks are built per sequence inside the attention function."""
    return None


def register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, _session_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


class ModelRunner:
    """Owns a causal LM and runs packed steps over session caches. Not thread-safe: one
    thread (the engine's) drives it."""

    def __init__(self, model: torch.nn.Module, tokenizer, name: str = "model") -> None:
        register_attention()
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        model.set_attn_implementation(ATTENTION_NAME)
        model.eval()
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        param = next(model.parameters())
        self.kv_shape = KVShape(
            layers=cfg.num_hidden_layers,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim, dtype=param.dtype, device=param.device,
        )
        self.context_window = int(getattr(cfg, "max_position_embeddings", 2048))
        self.device = param.device
        self.attention_backend = "reference"

    def set_attention_backend(self, requested: str | None) -> str:
        """Choose the attention backend (auto | reference | triton; None: the environment's
        STREAMER_ATTENTION_BACKEND, else auto); returns the one in use."""
        self.attention_backend = resolve_backend(requested, self.device)
        return self.attention_backend

    def new_cache(self, max_tokens: int | None = None) -> KVCache:
        return KVCache(self.kv_shape, max_tokens or self.context_window)

    @torch.inference_mode()
    def forward(self, seqs: Sequence[SeqStep], logits: str = "last") -> list[torch.Tensor] | None:
        """Run the new tokens of `seqs` in one forward; caches get the new K/V at their slots
        (the caller commits them). `logits`: "last" (one row per sequence), "all" (rows per
        token, per sequence) or "none"."""
        if not seqs:
            raise ValueError("forward needs at least one sequence")
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        for seq in seqs:
            if seq.n == 0:
                raise ValueError("a sequence in a step has no tokens")
            seq.cache.reserve(seq.start + seq.n)
            seq.offset = len(ids)
            ids.extend(seq.tokens)
            positions.append(torch.arange(seq.position, seq.position + seq.n))
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        position_ids = torch.cat(positions).unsqueeze(0).to(self.device)
        if logits == "all":
            keep: int | torch.Tensor = 0
        else:  # "none" still needs one row from the head; keep it to the last tokens
            keep = torch.tensor([s.offset + s.n - 1 for s in seqs], device=self.device)
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                         streamer_meta=StepMetadata(list(seqs), self.attention_backend), logits_to_keep=keep)
        rows = out.logits[0].float()
        if logits == "none":
            return None
        if logits == "all":
            return [rows[s.offset:s.offset + s.n] for s in seqs]
        return list(rows.unbind(0))
