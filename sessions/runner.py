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

from streamer.kernels.backend import ReferencePlan, plan_step, resolve_backend

from .kvcache import KVBuffer, KVCache, KVShape
from .weights import WeightsInfo, describe_weights

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

    cache: KVBuffer
    start: int
    tokens: Sequence[int]
    prefixes: tuple[tuple[KVBuffer, int], ...] = ()
    pos0: int | None = None
    offset: int = 0  # index of the first token in the packed batch
    embeds: torch.Tensor | None = None  # VL model: input embeddings `[n, hidden]` instead of the tokens'
    mpos: torch.Tensor | None = None  # VL model: explicit M-RoPE positions `[3, n]` (default: text positions)

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
    plan: object = None  # the step's attention plan (kernels.backend.plan_step), run by every layer

    def __post_init__(self) -> None:
        if self.plan is None:  # a caller outside the runner (one sequence, reference attention)
            self.plan = ReferencePlan(self.seqs, FORK_SUFFIX_MAX)


FORK_SUFFIX_MAX = 128  # own tokens up to which forks of one group are batched together


def _session_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       streamer_meta: StepMetadata | None = None, **kwargs):
    """transformers attention hook: query `[1, H, N, D]`, key/value `[1, Hkv, N, D]` (packed).

    Each sequence's new K/V go to its own cache at explicit slots; then the step's attention
    plan (built once for all layers, `kernels.backend.plan_step`) runs for this layer.
    """
    if streamer_meta is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention needs `streamer_meta`; run through ModelRunner")
    layer = module.layer_idx
    for seq in streamer_meta.seqs:
        own_start = seq.start - seq.cache.prefix_len
        k_cache, v_cache = seq.cache.layer(layer)
        k_cache[:, own_start:own_start + seq.n] = key[0, :, seq.offset:seq.offset + seq.n]
        v_cache[:, own_start:own_start + seq.n] = value[0, :, seq.offset:seq.offset + seq.n]
    out = query.new_empty((query.shape[2], query.shape[1], query.shape[3]))  # [N, H, D]
    if streamer_meta.backend == "triton":
        streamer_meta.plan.run(query[0].transpose(0, 1), layer, out=out, scaling=scaling)
    else:
        streamer_meta.plan.run(query[0], layer, out, scaling)
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

    def __init__(self, model: torch.nn.Module, tokenizer, name: str = "model",
                 weights: WeightsInfo | None = None) -> None:
        from .multimodal import vl_parts

        register_attention()
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.vl = vl_parts(model)  # a vision-language model (sessions/multimodal.py), or None
        if self.vl is not None:  # the vision tower keeps its own attention
            model.set_attn_implementation({"text_config": ATTENTION_NAME})
        else:
            model.set_attn_implementation(ATTENTION_NAME)
        model.eval()
        cfg = model.config if self.vl is None else model.config.text_config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        param = next(model.parameters())
        self.kv_shape = KVShape(
            layers=cfg.num_hidden_layers,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim, dtype=param.dtype, device=param.device,
        )
        self.heads = cfg.num_attention_heads
        self.context_window = int(getattr(cfg, "max_position_embeddings", 2048))
        self.device = param.device
        self.attention_backend = "reference"
        self.weights = weights or describe_weights(model)  # the linear layers' format (sessions/weights.py)
        self._inv_freq: torch.Tensor | None = None

    @property
    def inv_freq(self) -> torch.Tensor:
        """The model's rotary inverse frequencies (re-anchoring turns cached keys with them)."""
        if self._inv_freq is None:
            from .rope import inverse_frequencies

            self._inv_freq = inverse_frequencies(self.model if self.vl is None else self.vl.lm)
        return self._inv_freq

    def set_attention_backend(self, requested: str | None) -> str:
        """Choose the attention backend (auto | reference | triton; None: the environment's
        STREAMER_ATTENTION_BACKEND, else auto); returns the one in use."""
        self.attention_backend = resolve_backend(requested, self.device)
        return self.attention_backend

    def tokenize(self, text: str) -> list[int]:
        """Tokenize one piece on its own: never the concatenation with earlier text, so chunk
        boundaries never shift tokens that are already in the cache."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

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
            if self.vl is None and (seq.embeds is not None or seq.mpos is not None):
                raise ValueError(f"{self.name} is a text model: a step cannot carry embeddings or M-RoPE positions")
            seq.cache.reserve(seq.start + seq.n)
            seq.offset = len(ids)
            ids.extend(seq.tokens)
            positions.append(torch.arange(seq.position, seq.position + seq.n))
        if logits == "all":
            keep: int | torch.Tensor = 0
        else:  # "none" still needs one row from the head; keep it to the last tokens
            keep = torch.tensor([s.offset + s.n - 1 for s in seqs], device=self.device)
        shape = self.kv_shape
        plan = plan_step(seqs, self.attention_backend, self.heads, shape.kv_heads, shape.head_dim, self.device,
                         FORK_SUFFIX_MAX)
        meta = StepMetadata(list(seqs), self.attention_backend, plan)
        if self.vl is not None:
            rows = self._forward_vl(seqs, positions, meta, keep)
        else:
            input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
            position_ids = torch.cat(positions).unsqueeze(0).to(self.device)
            out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                             streamer_meta=meta, logits_to_keep=keep)
            rows = out.logits[0].float()
        if logits == "none":
            return None
        if logits == "all":
            return [rows[s.offset:s.offset + s.n] for s in seqs]
        return list(rows.unbind(0))

    def _forward_vl(self, seqs: Sequence[SeqStep], positions: list[torch.Tensor], meta: StepMetadata,
                    keep: int | torch.Tensor) -> torch.Tensor:
        """A VL model's language model over input embeddings (token embeddings, or a frame's own)
        with M-RoPE positions `[3, 1, N]`; logits of the rows in `keep` (0: all)."""
        vl = self.vl
        embeds = [seq.embeds.to(self.device, self.kv_shape.dtype) if seq.embeds is not None else vl.embed(seq.tokens)
                  for seq in seqs]
        mpos = [seq.mpos if seq.mpos is not None else p.expand(3, -1) for seq, p in zip(seqs, positions)]
        out = vl.lm(inputs_embeds=torch.cat(embeds)[None], position_ids=torch.cat(mpos, 1)[:, None, :].to(self.device),
                    use_cache=False, streamer_meta=meta)
        hidden = out.last_hidden_state[0]
        return vl.head(hidden if isinstance(keep, int) else hidden[keep]).float()
